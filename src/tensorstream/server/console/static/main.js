// The console's start: ask for the API key when the server needs one, then keep the
// timeline, the metrics, the model menu and the adapter list up to date.

import { AdaptersPanel } from "./adapters.js";
import { AuthRequired, forgetKey, getJSON, onAuthRequired, storeKey, storedKey } from "./api.js";
import { MetricsPanel } from "./metrics.js";
import { Playground } from "./playground.js";
import { renderAdapterLoads, renderTimeline, summary } from "./timeline.js";

const $ = (id) => document.getElementById(id);

let authNeeded = false;
let metricsStarted = false;
let statsRunning = false;
let status = "loading"; // of the model: loading, ready or failed

function showKeyPanel(message) {
  $("key-error").textContent = message || "";
  $("key-panel").hidden = false;
  $("console").setAttribute("aria-hidden", "true");
  $("console").inert = true;
  setStatus("API key needed", "warn");
  $("key-input").focus();
}

function hideKeyPanel() {
  $("key-panel").hidden = true;
  $("console").removeAttribute("aria-hidden");
  $("console").inert = false;
}

function setStatus(text, kind) {
  const pill = $("server-status");
  pill.textContent = text;
  pill.dataset.state = kind;
}

const metrics = new MetricsPanel({
  tiles: $("metrics"),
  spark: $("spark"),
  sparkCaption: $("spark-caption"),
  quantiles: $("quantiles"),
  updated: $("metrics-updated"),
});

const playground = new Playground({
  form: $("chat-form"),
  model: $("chat-model"),
  temperature: $("chat-temperature"),
  maxTokens: $("chat-max-tokens"),
  log: $("chat-log"),
  input: $("chat-input"),
  send: $("chat-send"),
  stop: $("chat-stop"),
  clear: $("chat-clear"),
  error: $("chat-error"),
});

const adapters = new AdaptersPanel(
  {
    list: $("adapter-list"),
    form: $("adapter-form"),
    name: $("adapter-name"),
    path: $("adapter-path"),
    keyfile: $("adapter-keyfile"),
    load: $("adapter-load"),
    message: $("adapter-message"),
    policy: $("adapters-policy"),
  },
  async () => Promise.all([refreshModels(), refreshStats()]),
);

async function refreshStats() {
  const stats = await getJSON("/v1/load_stats");
  renderTimeline($("timeline"), stats);
  renderAdapterLoads($("adapter-timeline"), stats);
  $("timeline-summary").textContent = summary(stats);
  adapters.setPolicy(stats.server);
  $("model-name").textContent = stats.server.served_model_name;
  status = stats.status;
  if (stats.status === "ready") setStatus("ready", "ok");
  else if (stats.status === "loading") setStatus("loading…", "warn");
  else setStatus("load failed", "error");
  return stats;
}

async function refreshModels() {
  const body = await getJSON("/v1/models");
  playground.setModels(body.data.map((m) => m.id));
  adapters.show(body.data);
}

/** Run `task`; false when the key was refused (the key panel is up), true otherwise. */
async function safely(task) {
  try {
    await task();
  } catch (err) {
    if (err instanceof AuthRequired) return false;
    setStatus(`error: ${err.message}`, "error");
  }
  return true;
}

async function statsLoop() {
  statsRunning = true;
  let authorized = await safely(refreshStats);
  // The model list exists only once ready (after a failed load the API answers 503).
  if (authorized && status === "ready") authorized = await safely(refreshModels);
  if (!authorized) {
    statsRunning = false; // resumes when a key is entered
    return;
  }
  // Every second while loading, then slowly (adapter actions refresh it at once).
  setTimeout(statsLoop, status === "loading" ? 1000 : 10000);
}

async function metricsLoop() {
  try {
    await metrics.refresh();
  } catch (err) {
    $("metrics-updated").textContent = `metrics unavailable: ${err.message}`;
  }
  setTimeout(metricsLoop, 2000);
}

function start() {
  hideKeyPanel();
  if (!statsRunning) statsLoop();
  if (!metricsStarted) {
    metricsStarted = true;
    metricsLoop();
  }
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  storeKey($("key-input").value);
  $("key-input").value = "";
  $("key-button").hidden = false;
  start();
});
$("key-forget").addEventListener("click", () => {
  forgetKey();
  $("key-input").value = "";
  $("key-error").textContent = "Key forgotten.";
});
$("key-button").addEventListener("click", () => showKeyPanel(""));
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && !$("key-panel").hidden && storedKey()) hideKeyPanel();
});
onAuthRequired((message) => showKeyPanel(message));

async function boot() {
  try {
    const config = await (await fetch("/console/config.json", { cache: "no-store" })).json();
    authNeeded = Boolean(config.auth);
  } catch (err) {
    setStatus(`cannot reach the server: ${err.message}`, "error");
    return;
  }
  $("key-button").hidden = !authNeeded;
  // Ask before calling the API, so a keyless visit sends no request that would be refused.
  if (authNeeded && !storedKey()) showKeyPanel("");
  else start();
}

boot();
