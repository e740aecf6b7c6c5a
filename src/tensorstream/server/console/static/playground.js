// The playground: a chat with the base model or a loaded adapter, streamed from
// /v1/chat/completions (server-sent events), with TTFT and tokens/s of each answer.

import { APIError, AuthRequired, api, errorMessage } from "./api.js";
import { el, rate } from "./format.js";

/** Yield each `data:` payload of a server-sent event stream (a fetch Response body). */
export async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) !== -1) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = event
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
    if (done) return;
  }
}

export class Playground {
  constructor({ form, model, temperature, maxTokens, log, input, send, stop, clear, error }) {
    Object.assign(this, { form, model, temperature, maxTokens, log, input, send, stop, clear, error });
    this.messages = [];
    this.controller = null;
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.ask();
    });
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.ask();
      }
    });
    stop.addEventListener("click", () => this.controller && this.controller.abort());
    clear.addEventListener("click", () => {
      this.messages = [];
      this.log.replaceChildren();
      this.error.textContent = "";
      this.input.focus();
    });
  }

  /** Offer `names` (base model first) in the model menu, keeping the current choice. */
  setModels(names) {
    const key = names.join("\n");
    if (key === this.shownModels) return; // unchanged: keep an open menu open
    this.shownModels = key;
    const current = this.model.value;
    this.model.replaceChildren(...names.map((n, i) => el("option", { value: n }, i === 0 ? `${n} (base)` : n)));
    if (names.includes(current)) this.model.value = current;
  }

  bubble(role, text) {
    const body = el("div", { class: "text" }, text);
    const node = el("div", { class: `msg ${role}`, "data-role": role }, el("div", { class: "who" }, role === "user" ? "You" : this.model.value), body);
    this.log.append(node);
    this.log.scrollTop = this.log.scrollHeight;
    return { node, body };
  }

  async ask() {
    const text = this.input.value.trim();
    if (!text || this.controller) return;
    this.error.textContent = "";
    this.input.value = "";
    this.messages.push({ role: "user", content: text });
    this.bubble("user", text);
    const answer = this.bubble("assistant", "");
    answer.node.dataset.done = "false";
    const stats = el("div", { class: "stats", "data-field": "stats" }, "waiting for the first token…");
    answer.node.append(stats);
    const body = {
      model: this.model.value,
      messages: this.messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: Number(this.temperature.value),
      max_tokens: Number(this.maxTokens.value),
    };
    this.controller = new AbortController();
    this.busy(true);
    const started = performance.now();
    let first = null;
    let last = null;
    let content = "";
    let chunks = 0;
    let usage = null;
    let finish = null;
    try {
      const response = await api("/v1/chat/completions", { method: "POST", json: body, signal: this.controller.signal });
      if (!response.ok) throw new APIError(response.status, await errorMessage(response));
      for await (const data of sseData(response)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new APIError(chunk.error.code, chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = (choice.delta && choice.delta.content) || "";
          if (choice.finish_reason) finish = choice.finish_reason;
          if (!delta) continue;
          last = performance.now();
          if (first === null) first = last;
          content += delta;
          chunks += 1;
          answer.body.textContent = content;
          this.log.scrollTop = this.log.scrollHeight;
        }
      }
      this.messages.push({ role: "assistant", content });
    } catch (err) {
      if (err.name === "AbortError") {
        finish = "stopped";
        if (content) this.messages.push({ role: "assistant", content });
      } else {
        this.messages.pop(); // the question goes unanswered; let the user retry it
        this.error.textContent = err instanceof AuthRequired ? "The API key is needed." : err.message;
        answer.node.classList.add("failed");
      }
    } finally {
      this.controller = null;
      this.busy(false);
    }
    const tokens = usage ? usage.completion_tokens : null;
    const ttft = first === null ? null : (first - started) / 1000;
    // Decode rate: tokens after the first over the time after the first.
    const tps = tokens > 1 && last > first ? (tokens - 1) / ((last - first) / 1000) : NaN;
    stats.textContent = [
      `TTFT ${ttft === null ? "–" : `${ttft.toFixed(2)} s`}`,
      rate(tps, "tok/s"),
      tokens === null ? null : `${tokens} tokens`,
      finish ? `finish: ${finish}` : null,
    ]
      .filter(Boolean)
      .join(" · ");
    answer.node.dataset.chunks = String(chunks);
    answer.node.dataset.done = "true";
    this.input.focus();
  }

  busy(on) {
    this.send.disabled = on;
    this.stop.disabled = !on;
  }
}
