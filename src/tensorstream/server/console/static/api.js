// Calls to this server's public API, with the API key the user typed (kept in sessionStorage,
// so it lives as long as the tab and is never written to disk by the page).

const KEY_NAME = "tensorstream.apiKey";

/** An API answer that was not 2xx; `message` is the server's own error message. */
export class APIError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

/** Thrown when the server wants a key we do not have (the key panel is shown). */
export class AuthRequired extends Error {}

export function storedKey() {
  return sessionStorage.getItem(KEY_NAME) || "";
}

export function storeKey(key) {
  sessionStorage.setItem(KEY_NAME, key);
}

export function forgetKey() {
  sessionStorage.removeItem(KEY_NAME);
}

let authHandler = () => {};

/** `handler(message)` runs whenever the server answers 401. */
export function onAuthRequired(handler) {
  authHandler = handler;
}

/** fetch() with the Bearer key; `json` becomes the body. Throws AuthRequired on 401. */
export async function api(path, { json, headers, ...options } = {}) {
  const all = new Headers(headers || {});
  const key = storedKey();
  if (key) all.set("Authorization", `Bearer ${key}`);
  if (json !== undefined) {
    all.set("Content-Type", "application/json");
    options.body = JSON.stringify(json);
  }
  const response = await fetch(path, { ...options, headers: all });
  if (response.status === 401) {
    authHandler(key ? "The server refused this key." : "");
    throw new AuthRequired("API key needed");
  }
  return response;
}

/** The server's message for a failed response: OpenAI error JSON, else the text. */
export async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return body.error.message;
  } catch {
    // not JSON: the text itself is the message
  }
  return text || `HTTP ${response.status}`;
}

/** GET `path` as JSON; throws APIError with the server's message otherwise. */
export async function getJSON(path) {
  const response = await api(path);
  if (!response.ok) throw new APIError(response.status, await errorMessage(response));
  return response.json();
}

/** POST `json` to `path`; returns the response text, throws APIError with the server's message. */
export async function postText(path, json) {
  const response = await api(path, { method: "POST", json });
  const text = response.ok ? await response.text() : await errorMessage(response);
  if (!response.ok) throw new APIError(response.status, text);
  return text;
}
