// Live metrics: /metrics every 2 s, parsed here (the server keeps the only bookkeeping).
// Tiles for the gauges and rates, a sparkline of the last two minutes, quantile table.

import { el, latency, rate, svg } from "./format.js";
import { parse, quantile, total } from "./prometheus.js";

const HISTORY = 60; // samples kept: two minutes at one every 2 s
const QUANTILES = [
  ["Time to first token", "vllm:time_to_first_token_seconds"],
  ["Request latency (end to end)", "vllm:e2e_request_latency_seconds"],
  ["Time per output token", "vllm:time_per_output_token_seconds"],
];

export class MetricsPanel {
  constructor({ tiles, spark, sparkCaption, quantiles, updated }) {
    Object.assign(this, { tiles, spark, sparkCaption, quantiles, updated });
    this.history = [];
    this.previous = null;
  }

  /** Fetch /metrics once and redraw. */
  async refresh() {
    const response = await fetch("/metrics", { cache: "no-store" });
    if (!response.ok) throw new Error(`/metrics answered ${response.status}`);
    this.show(parse(await response.text()), performance.now() / 1000);
  }

  show(samples, now) {
    const generated = total(samples, "vllm:generation_tokens_total") || 0;
    const prompt = total(samples, "vllm:prompt_tokens_total") || 0;
    let tokensPerSecond = NaN;
    if (this.previous && now > this.previous.time) {
      tokensPerSecond = Math.max(0, generated - this.previous.generated) / (now - this.previous.time);
    }
    this.previous = { time: now, generated };
    const running = total(samples, "vllm:num_requests_running") || 0;
    const waiting = total(samples, "vllm:num_requests_waiting") || 0;
    const finished = total(samples, "vllm:request_success_total") || 0;
    this.tiles.replaceChildren(
      tile("Running", String(running), "running"),
      tile("Waiting", String(waiting), "waiting"),
      tile("Generated tokens/s", rate(tokensPerSecond, "tok/s"), "tokens-per-second"),
      tile("Requests finished", String(finished), "finished"),
      tile("Tokens generated", String(generated), "generated"),
      tile("Prompt tokens", String(prompt), "prompt"),
    );
    this.quantiles.replaceChildren(
      ...QUANTILES.map(([label, name]) =>
        el(
          "tr",
          { "data-metric": name },
          el("th", { scope: "row" }, label),
          ...[0.5, 0.9, 0.99].map((q) => el("td", { class: "num" }, latency(quantile(samples, name, q)))),
        ),
      ),
    );
    if (Number.isFinite(tokensPerSecond)) {
      this.history.push({ tps: tokensPerSecond, running });
      if (this.history.length > HISTORY) this.history.shift();
    }
    this.drawSpark();
    this.updated.textContent = `from /metrics every 2 s; updated ${new Date().toLocaleTimeString()}`;
  }

  drawSpark() {
    const width = 300;
    const height = 56;
    const points = this.history;
    const peak = Math.max(1, ...points.map((p) => p.tps));
    const peakRunning = Math.max(1, ...points.map((p) => p.running));
    const step = width / (HISTORY - 1);
    const offset = (HISTORY - points.length) * step;
    const chart = svg("svg", {
      viewBox: `0 0 ${width} ${height}`,
      preserveAspectRatio: "none",
      width: "100%",
      height,
      role: "img",
      "aria-labelledby": "spark-caption",
    });
    points.forEach((p, i) => {
      const h = (p.running / peakRunning) * (height - 4) * 0.6;
      chart.append(svg("rect", { x: offset + i * step - step * 0.35, y: height - h, width: step * 0.7, height: h, class: "spark-bar" }));
    });
    if (points.length > 1) {
      const line = points.map((p, i) => `${offset + i * step},${height - 2 - (p.tps / peak) * (height - 6)}`).join(" ");
      chart.append(svg("polyline", { points: line, class: "spark-line", "vector-effect": "non-scaling-stroke" }));
    }
    this.spark.replaceChildren(chart);
    const tps = points.map((p) => p.tps);
    const peakText = tps.length ? rate(Math.max(...tps), "tok/s") : "–";
    const nowText = tps.length ? rate(tps[tps.length - 1], "tok/s") : "–";
    this.sparkCaption.textContent = `Generated tokens/s (line; peak ${peakText}, now ${nowText}) and running requests (bars), last 2 minutes`;
  }
}

function tile(label, value, key) {
  return el("div", { class: "tile" }, el("dt", {}, label), el("dd", { "data-metric": key }, value));
}
