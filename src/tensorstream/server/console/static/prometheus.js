// Prometheus' text exposition format (what /metrics serves): samples, sums and
// histogram quantiles, so the console shows the server's own numbers.

function parseValue(text) {
  if (text === "+Inf" || text === "Inf") return Infinity;
  if (text === "-Inf") return -Infinity;
  return Number(text); // "NaN" gives NaN
}

function parseLabels(text) {
  const labels = {};
  const pattern = /([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"/g;
  for (const match of text.matchAll(pattern)) {
    labels[match[1]] = match[2].replace(/\\n/g, "\n").replace(/\\(["\\])/g, "$1");
  }
  return labels;
}

/** Every sample line as {name, labels, value}; comments and blank lines are skipped. */
export function parse(text) {
  const samples = [];
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (!line || line.startsWith("#")) continue;
    let name;
    let labels = {};
    let rest;
    const brace = line.indexOf("{");
    const space = line.search(/\s/);
    if (brace !== -1 && (space === -1 || brace < space)) {
      name = line.slice(0, brace);
      let i = brace + 1;
      let quoted = false;
      for (; i < line.length; i++) {
        const c = line[i];
        if (quoted && c === "\\") i++;
        else if (c === '"') quoted = !quoted;
        else if (c === "}" && !quoted) break;
      }
      labels = parseLabels(line.slice(brace + 1, i));
      rest = line.slice(i + 1).trim();
    } else {
      name = line.slice(0, space);
      rest = line.slice(space + 1).trim();
    }
    samples.push({ name, labels, value: parseValue(rest.split(/\s+/)[0]) });
  }
  return samples;
}

/** The sum of every sample named `name` (over all label sets); null when there is none. */
export function total(samples, name) {
  let sum = null;
  for (const s of samples) if (s.name === name) sum = (sum || 0) + s.value;
  return sum;
}

/**
 * The q-quantile of histogram `base` (its `_bucket` samples summed over other labels),
 * interpolated linearly inside the bucket as histogram_quantile() does. null without
 * observations; the highest finite bound when the rank falls in the +Inf bucket.
 */
export function quantile(samples, base, q) {
  const byBound = new Map();
  for (const s of samples) {
    if (s.name !== `${base}_bucket`) continue;
    const le = parseValue(s.labels.le);
    byBound.set(le, (byBound.get(le) || 0) + s.value);
  }
  const buckets = [...byBound.entries()].sort((a, b) => a[0] - b[0]);
  if (!buckets.length) return null;
  const count = buckets[buckets.length - 1][1];
  if (!(count > 0)) return null;
  const rank = q * count;
  let lowerBound = 0;
  let lowerCount = 0;
  for (const [bound, cumulative] of buckets) {
    if (cumulative >= rank) {
      if (bound === Infinity) return lowerBound;
      const inBucket = cumulative - lowerCount;
      if (inBucket <= 0) return bound;
      return lowerBound + ((bound - lowerBound) * (rank - lowerCount)) / inBucket;
    }
    lowerBound = bound;
    lowerCount = cumulative;
  }
  return lowerBound;
}
