// The start-up timeline and the adapter loads, drawn as inline SVG bars from /v1/load_stats.
// Each phase is a table row: its name, a bar on a shared time axis, and the figures beside it.

import { bytes, el, seconds, svg, tickStep } from "./format.js";

const BAR_HEIGHT = 14;

/** What a phase row says beside its bar (bytes, GB/s, readers...). */
export function phaseDetail(phase) {
  if (phase.name !== "weights_read") return "";
  const parts = [];
  if (phase.bytes_read > 0 && phase.bytes_read < 1e6) {
    parts.push(`${bytes(phase.bytes_read)} read`); // too little for a meaningful rate
  } else if (phase.bytes_read > 0) {
    parts.push(`${bytes(phase.bytes_read)} read, ${phase.gb_per_s.toFixed(2)} GB/s`);
  }
  if (phase.mapped_bytes > 0) parts.push(`${bytes(phase.mapped_bytes)} mapped (read on first use)`);
  if (phase.readers) parts.push(`${phase.readers} readers`);
  return parts.join("; ");
}

function tickLabel(t, step) {
  if (step < 0.1) return `${Number((t * 1000).toFixed(1))} ms`;
  return `${Number(t.toFixed(3))} s`;
}

function axis(scale) {
  const step = tickStep(scale / 1.04, 4); // ticks over the data, not the end padding
  const g = svg("svg", { class: "axis", width: "100%", height: 16, "aria-hidden": "true" });
  for (let t = 0; t <= scale + 1e-9; t += step) {
    const x = `${(t / scale) * 100}%`;
    const anchor = t === 0 ? "start" : t + step > scale + 1e-9 && t / scale > 0.95 ? "end" : "middle";
    g.append(svg("line", { x1: x, x2: x, y1: 11, y2: 16, class: "tick" }));
    const label = svg("text", { x, y: 9, "text-anchor": anchor });
    label.textContent = tickLabel(t, step);
    g.append(label);
  }
  return g;
}

function bar(start, end, scale, kind, title) {
  const g = svg("svg", { class: "bar", width: "100%", height: BAR_HEIGHT + 4, "aria-hidden": "true" });
  const x = (Math.max(0, start) / scale) * 100;
  const width = Math.max(((end - start) / scale) * 100, 0.4); // a 0 ms phase stays visible
  const rect = svg("rect", {
    x: `${x}%`,
    y: 2,
    width: `${Math.min(width, 100 - x)}%`,
    height: BAR_HEIGHT,
    rx: 3,
    class: `fill-${kind}`,
  });
  const tip = svg("title");
  tip.textContent = title;
  rect.append(tip);
  g.append(rect);
  return g;
}

function marker(at, scale) {
  const g = svg("svg", { class: "bar", width: "100%", height: BAR_HEIGHT + 4, "aria-hidden": "true" });
  const x = `${Math.min(100, (at / scale) * 100)}%`;
  g.append(svg("line", { x1: x, x2: x, y1: 0, y2: BAR_HEIGHT + 4, class: "ready-line" }));
  g.append(svg("circle", { cx: x, cy: (BAR_HEIGHT + 4) / 2, r: 5, class: "ready-dot" }));
  return g;
}

function table(headers, rows, label) {
  return el(
    "table",
    { class: "tl", "aria-label": label },
    el("thead", {}, el("tr", {}, headers.map((h) => (h instanceof Node ? el("th", { scope: "col", class: "axis-cell" }, h) : el("th", { scope: "col" }, h))))),
    el("tbody", {}, rows),
  );
}

/** Draw the start-up phases of `stats` into `container`. */
export function renderTimeline(container, stats) {
  const phases = stats.phases || [];
  const now = stats.now || 0;
  const ends = phases.map((p) => (p.end === null ? now : p.end));
  // 4 % room on the right, so the ready marker is not cut at the edge.
  const scale = 1.04 * Math.max(stats.ready_at || 0, ...ends, stats.status === "loading" ? now : 0, 0.01);
  const rows = phases.map((p) => {
    const end = p.end === null ? now : p.end;
    const took = p.end === null ? "running" : seconds(p.seconds);
    return el(
      "tr",
      { "data-phase": p.name },
      el("th", { scope: "row" }, p.label),
      el("td", { class: "bar-cell" }, bar(p.start, end, scale, p.name, `${p.label}: ${seconds(p.start)} → ${seconds(end)}`)),
      el("td", { class: "num", "data-field": "start" }, seconds(p.start)),
      el("td", { class: "num", "data-field": "seconds" }, took),
      el("td", { class: "detail", "data-field": "detail" }, phaseDetail(p)),
    );
  });
  if (stats.status === "loading") {
    rows.push(
      el(
        "tr",
        { "data-phase": "loading" },
        el("th", { scope: "row" }, "loading…"),
        el("td", { class: "bar-cell" }, marker(now, scale)),
        el("td", { class: "num" }, seconds(now)),
        el("td", { class: "num" }, ""),
        el("td", { class: "detail" }, "the API answers 503 until ready"),
      ),
    );
  }
  if (stats.ready_at !== null && stats.ready_at !== undefined) {
    rows.push(
      el(
        "tr",
        { "data-phase": "ready" },
        el("th", { scope: "row" }, "ready"),
        el("td", { class: "bar-cell" }, marker(stats.ready_at, scale)),
        el("td", { class: "num", "data-field": "start" }, seconds(stats.ready_at)),
        el("td", { class: "num" }, ""),
        el("td", { class: "detail" }, "serving requests"),
      ),
    );
  }
  if (!rows.length) {
    container.replaceChildren(el("p", { class: "hint" }, "No start-up phases were recorded (the model was loaded before this server object)."));
    return;
  }
  container.replaceChildren(
    table(["Phase", axis(scale), "At", "Took", "Figures"], rows, "Start-up phases, seconds since the process started"),
  );
}

/** Draw each adapter load of `stats` into `container`, on its own time scale. */
export function renderAdapterLoads(container, stats) {
  const loads = stats.adapters || [];
  if (!loads.length) {
    container.replaceChildren(el("p", { class: "hint" }, "No adapter loaded yet."));
    return;
  }
  const scale = 1.04 * Math.max(...loads.map((a) => a.seconds), 0.001);
  const rows = loads.map((a) =>
    el(
      "tr",
      { "data-adapter": a.name },
      el("th", { scope: "row" }, a.name, el("span", { class: "tag" }, a.source)),
      el("td", { class: "bar-cell" }, bar(0, a.seconds, scale, "adapter", `${a.name}: ${seconds(a.seconds)}`)),
      el("td", { class: "num", "data-field": "start" }, seconds(a.start)),
      el("td", { class: "num", "data-field": "seconds" }, seconds(a.seconds)),
      el("td", { class: "detail" }, a.unloaded_at === null ? a.path : `${a.path} (unloaded at ${seconds(a.unloaded_at)})`),
    ),
  );
  container.replaceChildren(table(["Adapter", axis(scale), "At", "Took", "From"], rows, "Adapter loads, each bar from the start of its load"));
}

/** One line over the timeline: when the server became ready and what the load did. */
export function summary(stats) {
  if (stats.status === "failed") return `Loading failed: ${stats.error}`;
  if (stats.status === "loading") return `Loading… ${seconds(stats.now)} since the process started`;
  const m = stats.model;
  const parts = [];
  if (stats.ready_at !== null) parts.push(`ready ${seconds(stats.ready_at)} after the process started`);
  if (m) parts.push(`weights usable after ${seconds(m.usable_seconds)} (${m.load_format}, ${bytes(m.bytes)})`);
  return parts.join("; ");
}
