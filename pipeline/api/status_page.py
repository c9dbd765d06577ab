"""The ``/status`` page: one self-contained HTML document, no external assets.

The report (:meth:`pipeline.observe.status.StatusBoard.report`) is embedded in the page, so it
renders at once, and fetched again from ``status.json`` every 15 seconds. The charts
are inline SVG drawn by a few lines of vanilla JavaScript: the page works air-gapped.
"""

from __future__ import annotations

from typing import Any

import orjson

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>freshline status</title>
<style>
  :root { --ink:#1d2430; --muted:#5d6878; --line:#d8dee8; --bg:#f5f7fa; --card:#fff;
          --good:#1a7f4b; --warn:#b26a00; --bad:#c0392b; --accent:#2f6fdf; }
  * { box-sizing: border-box; }
  body { margin:0; font:14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
         color:var(--ink); background:var(--bg); }
  header { display:flex; align-items:baseline; gap:16px; padding:16px 24px;
           background:var(--ink); color:#fff; }
  header h1 { margin:0; font-size:20px; font-weight:600; }
  header .meta { color:#c9d2e0; font-size:13px; }
  main { padding:16px 24px 32px; max-width:1400px; }
  .problems { margin:0 0 16px; padding:10px 14px; border-left:4px solid var(--bad);
              background:#fdecea; color:#7b1f16; }
  .problems:empty { display:none; }
  .problems li { margin:2px 0; }
  .card { background:var(--card); border:1px solid var(--line); border-radius:8px;
          padding:14px 16px; margin-bottom:16px; }
  .card h2 { margin:0 0 8px; font-size:17px; }
  .card h2 small { color:var(--muted); font-weight:400; font-size:13px; margin-left:8px; }
  .figures { display:flex; flex-wrap:wrap; gap:28px; margin:4px 0 12px; }
  .figure .label { color:var(--muted); font-size:12px; text-transform:uppercase;
                   letter-spacing:.04em; }
  .figure .big { font-size:30px; font-weight:650; font-variant-numeric:tabular-nums; }
  .figure .sub { color:var(--muted); font-size:12px; }
  .good { color:var(--good); } .warn { color:var(--warn); } .bad { color:var(--bad); }
  .charts { display:grid; grid-template-columns:repeat(auto-fill, minmax(300px, 1fr));
            gap:12px; }
  .chart { border-top:1px solid var(--line); padding-top:6px; }
  .chart .title { font-size:12px; color:var(--muted); margin-bottom:2px; }
  svg text { font-size:10px; fill:var(--muted); font-family:inherit; }
  svg .axis { stroke:#9aa5b4; stroke-width:1; }
  svg .grid { stroke:#edf0f5; stroke-width:1; }
  svg .series { fill:none; stroke:var(--accent); stroke-width:2; }
  svg .limit { stroke:var(--bad); stroke-dasharray:4 3; stroke-width:1.2; }
  svg .dot { fill:var(--accent); }
  footer { color:var(--muted); font-size:12px; padding:0 24px 24px; }
</style>
</head>
<body>
<header><h1>freshline status</h1><span class="meta" id="meta"></span></header>
<main>
  <ul class="problems" id="problems"></ul>
  <section class="card" id="pipeline">
    <h2>Pipeline <small>freshness lag: source commit to Redis write, all feature sets</small></h2>
    <div class="figures"><div class="figure"><div class="label">Freshness lag (5 min mean)</div>
      <div class="big" id="freshness-current">&ndash;</div>
      <div class="sub" id="freshness-sub"></div></div></div>
    <div class="charts"><div class="chart"><div class="title">Freshness lag per minute (s)</div>
      <div id="freshness-chart"></div></div></div>
  </section>
  <div id="sets"></div>
  <section class="card" id="semantic">
    <h2>Semantic cache <small>LLM responses, last 5 minutes, per model</small></h2>
    <div class="figures" id="semantic-models"></div>
  </section>
</main>
<footer>Refreshes every 15 s. Hit rate and freshness lag over the last 5 minutes; staleness is the
oldest entry in a random sample of Redis keys, against the TTL (dashed); consumer lag is read from
the broker. Charts: the last hour, one point a minute.</footer>
<script id="initial" type="application/json">__DATA__</script>
<script>
"use strict";
const NS = "http://www.w3.org/2000/svg";
const W = 320, H = 140, L = 44, R = 10, T = 10, B = 24;

function el(tag, attrs, text) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

function fmtNum(v, unit) {
  if (v === null || v === undefined || Number.isNaN(v)) return "\\u2013";
  if (unit === "%") return (v * 100).toFixed(1) + "%";
  if (unit === "s") {
    if (v < 1) return (v * 1000).toFixed(0) + " ms";
    if (v < 120) return v.toFixed(1) + " s";
    if (v < 7200) return (v / 60).toFixed(1) + " min";
    return (v / 3600).toFixed(1) + " h";
  }
  return Math.round(v).toLocaleString("en-US");
}

function tickLabel(v, unit) {
  if (unit === "%") return Math.round(v * 100) + "%";
  if (unit === "s") return v >= 120 ? Math.round(v / 60) + "m" : (+v.toFixed(2)) + "s";
  return v >= 1000 ? (v / 1000) + "k" : String(+v.toFixed(2));
}

function chart(times, values, opts) {
  const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
                         "aria-label": opts.label});
  const now = opts.now, span = opts.window;
  const finite = values.filter(v => v !== null && v !== undefined);
  const peak = Math.max(opts.limit || 0, ...finite, 0) * 1.1;
  const top = opts.unit === "%" ? 1
    : opts.unit === "s" && peak > 120 ? niceMax(peak / 60) * 60 : niceMax(peak);
  const x = t => L + (W - L - R) * (1 - (now - t) / span);
  const y = v => T + (H - T - B) * (1 - Math.max(0, Math.min(v, top)) / top);
  for (let i = 0; i <= 4; i++) {
    const v = top * i / 4;
    svg.append(el("line", {class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v)}));
    svg.append(el("text", {x: L - 4, y: y(v) + 3, "text-anchor": "end"}, tickLabel(v, opts.unit)));
  }
  for (const m of [60, 45, 30, 15, 0]) {
    const t = now - m * 60;
    svg.append(el("text", {x: x(t), y: H - 8, "text-anchor": "middle"},
                  m === 0 ? "now" : "-" + m + "m"));
  }
  svg.append(el("line", {class: "axis", x1: L, x2: L, y1: T, y2: H - B}));
  svg.append(el("line", {class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B}));
  if (opts.limit) {
    const ly = y(opts.limit);
    svg.append(el("line", {class: "limit", x1: L, x2: W - R, y1: ly, y2: ly}));
    svg.append(el("text", {x: W - R, y: ly - 3, "text-anchor": "end"}, opts.limitLabel));
  }
  let d = "", pen = false, last = null;
  times.forEach((t, i) => {
    const v = values[i];
    if (v === null || v === undefined || now - t > span) { pen = false; return; }
    d += (pen ? "L" : "M") + x(t).toFixed(1) + "," + y(v).toFixed(1);
    pen = true;
    last = [x(t), y(v)];
  });
  if (d) svg.append(el("path", {class: "series", d: d}));
  if (last) svg.append(el("circle", {class: "dot", cx: last[0], cy: last[1], r: 3}));
  if (!finite.length) svg.append(el("text", {x: (L + W) / 2, y: H / 2, "text-anchor": "middle"},
                                     "no data yet"));
  return svg;
}

function figure(label, value, sub, cls, key, name) {
  const div = document.createElement("div");
  div.className = "figure";
  const l = document.createElement("div"); l.className = "label"; l.textContent = label;
  const b = document.createElement("div"); b.className = "big " + (cls || "");
  b.textContent = value; b.dataset.metric = key; b.dataset.set = name;
  const s = document.createElement("div"); s.className = "sub"; s.textContent = sub || "";
  div.append(l, b, s);
  return div;
}

function chartBox(title, svg) {
  const div = document.createElement("div");
  div.className = "chart";
  const t = document.createElement("div"); t.className = "title"; t.textContent = title;
  div.append(t, svg);
  return div;
}

function render(data) {
  const now = data.generated_at, span = data.window_s;
  document.getElementById("meta").textContent =
    `schema version ${data.schema_version} \\u00b7 updated ` +
    new Date(now * 1000).toLocaleTimeString("en-GB") +
    (data.broker_reachable ? "" : " \\u00b7 broker unreachable: no consumer lag");
  const problems = document.getElementById("problems");
  problems.replaceChildren(...data.problems.map(p => {
    const li = document.createElement("li"); li.textContent = p; return li; }));

  const fr = data.freshness;
  document.getElementById("freshness-current").textContent = fmtNum(fr.current_s, "s");
  document.getElementById("freshness-sub").textContent =
    fr.reachable ? (fr.current_s === null ? "no events applied in the window" : "")
                 : "consumer metrics unreachable";
  document.getElementById("freshness-chart").replaceChildren(
    chart(fr.series.t, fr.series.lag_s || [], {now, window: span, unit: "s",
                                                label: "freshness lag"}));

  const sets = document.getElementById("sets");
  sets.replaceChildren(...data.feature_sets.map(fs => {
    const c = fs.current, card = document.createElement("section");
    card.className = "card"; card.id = "set-" + fs.name;
    const h = document.createElement("h2"); h.textContent = fs.name;
    const small = document.createElement("small");
    small.textContent = `TTL ${fmtNum(fs.ttl_s, "s")}`; h.append(small);
    const hr = c.hit_rate;
    const hrCls = hr === null ? "" : hr < 0.25 ? "bad" : hr < 0.4 ? "warn" : "good";
    const st = c.staleness_s;
    const stCls = st === null ? "" : st > fs.ttl_s ? "bad" : st > 0.9 * fs.ttl_s ? "warn" : "good";
    const lagCls = c.consumer_lag === null ? "" : c.consumer_lag > 1000 ? "warn" : "good";
    const figs = document.createElement("div"); figs.className = "figures";
    figs.append(
      figure("Hit rate (5 min)", fmtNum(hr, "%"),
             `${fmtNum(c.hits)} hits, ${fmtNum(c.misses)} misses`, hrCls, "hit_rate", fs.name),
      figure("Staleness (oldest entry)", fmtNum(st, "s"),
             `of ${fmtNum(fs.ttl_s, "s")} TTL \\u00b7 ${c.sampled} sampled` +
             (c.over_ttl ? ` \\u00b7 ${c.over_ttl} over TTL` : ""), stCls, "staleness", fs.name),
      figure("Consumer lag", c.consumer_lag === null ? "\\u2013" : fmtNum(c.consumer_lag),
             "records behind, topics feeding this set", lagCls, "consumer_lag", fs.name));
    const s = fs.series;
    const charts = document.createElement("div"); charts.className = "charts";
    charts.append(
      chartBox("Hit rate per minute", chart(s.t, s.hit_rate || [],
               {now, window: span, unit: "%", label: fs.name + " hit rate"})),
      chartBox("Staleness: oldest sampled entry (s)", chart(s.t, s.staleness_s || [],
               {now, window: span, unit: "s", limit: fs.ttl_s, limitLabel: "TTL",
                label: fs.name + " staleness"})),
      chartBox("Consumer lag (records)", chart(s.t, s.consumer_lag || [],
               {now, window: span, unit: "", label: fs.name + " consumer lag"})));
    card.append(h, figs, charts);
    return card;
  }));
  const sem = data.semantic || [];
  document.getElementById("semantic-models").replaceChildren(...(sem.length ? sem.map(m => {
    const cls = m.hit_rate === null ? "" : m.hit_rate < 0.25 ? "bad" : "good";
    return figure(m.model + " hit rate", fmtNum(m.hit_rate, "%"),
                  `${fmtNum(m.hits)} hits, ${fmtNum(m.misses)} misses, ` +
                  `${fmtNum(m.flagged)} flagged, ${fmtNum(m.refused)} refused`,
                  cls, "semantic_hit_rate", m.model);
  }) : [figure("Lookups", "\u2013", "no semantic cache lookups yet", "", "semantic", "")]));
  document.body.dataset.rendered = String(now);
}

async function refresh() {
  try {
    const response = await fetch("status.json", {cache: "no-store"});
    if (response.ok) render(await response.json());
  } catch (err) {
    document.getElementById("meta").textContent = "refresh failed; retrying";
  }
}

render(JSON.parse(document.getElementById("initial").textContent));
setInterval(refresh, 15000);
</script>
</body>
</html>
"""


def page(report: dict[str, Any]) -> bytes:
    """The page with ``report`` embedded (``</`` escaped so it cannot end the script)."""
    data = orjson.dumps(report).replace(b"</", b"<\\/")
    return _PAGE.encode().replace(b"__DATA__", data)
