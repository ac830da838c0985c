// The federation live: fed by the dashboard's SSE stream (/api/events), drawn with uPlot.
// A snapshot when the stream opens, then views (the sites' rows), timeline points and events.
// Everything shown is written as text, never as HTML: a mark's label is anyone's words.
"use strict";

const SITE_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"];
const EVENT_COLORS = {
  mark: "#000", down: "#d62728", drain: "#ff7f0e", join: "#2ca02c", ready: "#2ca02c",
  removed: "#7f7f7f", resume: "#9467bd",
};
const COLUMNS = [
  ["site", "site"], ["state", "state"], ["gpus", "GPUs"], ["workers", "workers"],
  ["capacity", "capacity tok/s (measured / prior)"], ["tok_s", "tok/s"],
  ["token_share", "token share"], ["capacity_share", "capacity share"],
  ["ttft", "TTFT p50 / p99"], ["tpot", "TPOT p50 / p99"],
];

let limits = { timeline_points: 600, events_kept: 200 };
let timeline = [];
let events = [];
let chart = null;
let chartSites = [];

const number = (x, digits = 0) =>
  x == null ? "—" : x.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
const percent = (x) => (x == null ? "—" : (100 * x).toFixed(1) + " %");
const millis = (s) => (s == null ? "—" : (1000 * s).toFixed(s < 0.1 ? 1 : 0) + " ms");
const clock = (unix) => new Date(unix * 1000).toLocaleTimeString("en-GB");

function element(tag, text, attributes = {}) {
  const node = document.createElement(tag);
  if (text != null) node.textContent = text;
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  return node;
}

function siteColor(name) {
  const index = chartSites.indexOf(name);
  return index < 0 ? "#999" : SITE_COLORS[index % SITE_COLORS.length];
}

function siteCells(site) {
  return {
    site: site.name,
    state: site.state,
    gpus: `${site.gpus} × ${site.gpu.toUpperCase()}`,
    workers: `${site.healthy_workers} / ${site.total_workers}`,
    capacity: `${number(site.capacity_tok_s)} / ${number(site.prior_capacity_tok_s)}`,
    tok_s: number(site.tok_s),
    token_share: percent(site.token_share),
    capacity_share: percent(site.capacity_share),
    ttft: `${millis(site.ttft_p50_s)} / ${millis(site.ttft_p99_s)}`,
    tpot: `${millis(site.tpot_p50_s)} / ${millis(site.tpot_p99_s)}`,
  };
}

function regionRow(region, gatewayRegion) {
  const rtt = region.rtt_ms_to_gateway;
  const where = region.name === gatewayRegion ? "the gateway's region"
    : rtt == null ? "no link to the gateway's region in the config"
    : `${number(rtt)} ms round trip to the gateway (${gatewayRegion})`;
  const row = element("tr", null, { class: "region", "data-region": region.name });
  row.append(element("th", `${region.name} · ${where}`, { colspan: COLUMNS.length }));
  return row;
}

// Measured / declared are both in the site's clock: real GPUs' (1), or an emulated site's --speed.
function capacityNote(site) {
  const notes = [`evidence: ${site.capacity_evidence || "—"}`, `clock: ×${site.clock_speed}`];
  if (site.agent_ceiling_tok_s > 0) notes.push(`agent at its CPU ceiling: ${number(site.agent_ceiling_tok_s)} tok/s`);
  return notes.join(" · ");
}

function siteRow(site) {
  const row = element("tr", null, { "data-site": site.name });
  const cells = siteCells(site);
  for (const [field] of COLUMNS) {
    const cell = row.appendChild(element("td", null, { "data-field": field }));
    if (field === "site") cell.appendChild(element("span", null, { class: "swatch" })).style.background = siteColor(site.name);
    cell.append(cells[field]);
    if (field === "state") cell.className = `state-${site.state}`;
    if (field === "capacity") cell.title = capacityNote(site);
  }
  return row;
}

function renderSites(view) {
  const head = element("tr");
  for (const [, title] of COLUMNS) head.append(element("th", title));
  const rows = [];
  for (const region of view.regions) {
    rows.push(regionRow(region, view.gateway_region), ...region.sites.map(siteRow));
  }
  document.querySelector("#sites thead").replaceChildren(head);
  document.querySelector("#sites tbody").replaceChildren(...rows);
}

function renderView(view) {
  document.getElementById("model").textContent = view.model;
  const scheduler = document.getElementById("scheduler");
  scheduler.textContent = view.scheduler ? `scheduler ${view.scheduler}`
    : view.seen_state ? "no scheduler replica answers: the last state seen" : "no scheduler replica answers yet";
  scheduler.classList.toggle("bad", !view.scheduler);
  const gateway = document.getElementById("gateway");
  gateway.textContent = view.gateway.error ? `gateway ${view.gateway.url}: ${view.gateway.error}` : `gateway ${view.gateway.url}`;
  gateway.classList.toggle("bad", Boolean(view.gateway.error));
  renderSites(view);
  const links = document.querySelector("#links tbody");
  links.replaceChildren(...view.links.map((link) => {
    const row = element("tr");
    row.append(element("td", `${link.between[0]} ↔ ${link.between[1]}`), element("td", `${number(link.rtt_ms)} ms`));
    return row;
  }));
}

function renderEvents() {
  const list = document.getElementById("events");
  list.replaceChildren(...events.slice().reverse().map((event) => {
    const item = element("li", null, { "data-kind": event.kind });
    item.append(element("time", clock(event.at_unix_s)));
    item.appendChild(element("span", event.kind, { class: "kind" })).style.color = EVENT_COLORS[event.kind] || "#000";
    item.append(event.label);
    return item;
  }));
}

// ---- the timeline ------------------------------------------------------------------------

function timelineSites() {
  const names = new Set();
  for (const point of timeline) for (const name of Object.keys(point.tok_s)) names.add(name);
  return [...names].sort();
}

function chartData() {
  return [
    timeline.map((point) => point.at_unix_s),
    ...chartSites.map((name) => timeline.map((point) => point.tok_s[name] ?? null)),
  ];
}

function drawEvents(u) {
  const ctx = u.ctx;
  const [min, max] = [u.scales.x.min, u.scales.x.max];
  const top = u.bbox.top, height = u.bbox.height;
  const ratio = window.devicePixelRatio || 1;
  ctx.save();
  ctx.font = `${12 * ratio}px system-ui, sans-serif`;
  ctx.textAlign = "left";
  ctx.textBaseline = "alphabetic";
  let labelled = 0;
  for (const event of events) {
    if (event.at_unix_s < min || event.at_unix_s > max) continue;
    const x = Math.round(u.valToPos(event.at_unix_s, "x", true));
    ctx.strokeStyle = ctx.fillStyle = EVENT_COLORS[event.kind] || "#000";
    ctx.lineWidth = (event.kind === "mark" ? 2 : 1) * ratio;
    ctx.setLineDash(event.kind === "resume" ? [3 * ratio, 3 * ratio] : []);
    ctx.beginPath();
    ctx.moveTo(x, top);
    ctx.lineTo(x, top + height);
    ctx.stroke();
    ctx.fillText(event.label, x + 4 * ratio, top + (14 + 14 * (labelled++ % 5)) * ratio);
  }
  ctx.restore();
}

function buildChart() {
  const box = document.getElementById("timeline");
  if (chart) chart.destroy();
  chartSites = timelineSites();
  chart = new uPlot({
    width: Math.max(400, box.clientWidth),
    height: 280,
    scales: { x: { time: true } },
    series: [
      {},
      ...chartSites.map((name, i) => ({
        label: name, stroke: SITE_COLORS[i % SITE_COLORS.length], width: 2, points: { show: false },
        value: (u, v) => number(v),
      })),
    ],
    axes: [{}, { label: "tokens/s", size: 70 }],
    hooks: { draw: [drawEvents] },
  }, chartData(), box);
}

function addPoint(point) {
  timeline.push(point);
  if (timeline.length > limits.timeline_points) timeline.shift();
  const sites = timelineSites();
  if (!chart || sites.join() !== chartSites.join()) buildChart();
  else chart.setData(chartData());
}

// ---- the stream --------------------------------------------------------------------------

function connect() {
  const stream = new EventSource("/api/events");
  const connection = document.getElementById("connection");
  stream.addEventListener("open", () => {
    connection.textContent = "live";
    connection.classList.remove("bad");
  });
  stream.addEventListener("error", () => {
    connection.textContent = "disconnected: retrying";
    connection.classList.add("bad");
  });
  stream.addEventListener("snapshot", (message) => {
    const snapshot = JSON.parse(message.data);
    limits = { timeline_points: snapshot.timeline_points, events_kept: snapshot.events_kept };
    timeline = snapshot.timeline;
    events = snapshot.events;
    buildChart();
    renderView(snapshot);
    renderEvents();
  });
  stream.addEventListener("view", (message) => renderView(JSON.parse(message.data)));
  stream.addEventListener("point", (message) => addPoint(JSON.parse(message.data)));
  stream.addEventListener("event", (message) => {
    events.push(JSON.parse(message.data));
    if (events.length > limits.events_kept) events.shift();
    renderEvents();
    if (chart) chart.redraw(false);
  });
}

window.addEventListener("resize", () => {
  if (chart) chart.setSize({ width: Math.max(400, document.getElementById("timeline").clientWidth), height: 280 });
});
connect();
