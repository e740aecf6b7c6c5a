// Number formatting and small DOM/SVG builders shared by the panels.

const SVG_NS = "http://www.w3.org/2000/svg";

/** Seconds with two decimals ("1.05 s"); "–" when unknown. */
export function seconds(value) {
  return value === null || value === undefined ? "–" : `${value.toFixed(2)} s`;
}

/** A latency: milliseconds below one second, else seconds. */
export function latency(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  return value < 1 ? `${(value * 1000).toFixed(0)} ms` : `${value.toFixed(2)} s`;
}

/** Bytes in decimal units, as the server's log line writes them ("269.0 MB"). */
export function bytes(value) {
  if (value >= 1e9) return `${(value / 1e9).toFixed(2)} GB`;
  if (value >= 1e6) return `${(value / 1e6).toFixed(1)} MB`;
  if (value >= 1e3) return `${(value / 1e3).toFixed(1)} kB`;
  return `${value} B`;
}

/** A rate with one decimal, "–" when not a finite number. */
export function rate(value, unit) {
  return Number.isFinite(value) ? `${value.toFixed(1)} ${unit}` : "–";
}

/** An HTML element with attributes and children (strings become text, never HTML). */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** An SVG element with attributes. */
export function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  for (const child of children) node.append(child);
  return node;
}

/** A tick step of 1, 2 or 5 x 10^n giving about `count` ticks up to `max`. */
export function tickStep(max, count = 5) {
  const raw = Math.max(max, 1e-6) / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 5, 10]) if (m * power >= raw) return m * power;
  return 10 * power;
}
