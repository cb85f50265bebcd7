// The limits page: polls /api/state and draws it. No framework, no CDN; every value is
// written with textContent (limit names and keys come from users' data).
"use strict";

const W = 260, H = 56;
let interval = 2000;
let control = false;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
  }
  return node;
}

function num(x, digits) {
  if (x === null || x === undefined) return "–";
  if (Math.abs(x - Math.round(x)) < 0.005) return String(Math.round(x));
  return x.toFixed(digits === undefined ? 2 : digits);
}

function dur(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return Math.round(s * 1000) + "ms";
  if (s < 120) return (Math.round(s * 10) / 10) + "s";
  if (s < 7200) return Math.floor(s / 60) + "m" + String(Math.round(s % 60)).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
}

function holdText(hold) {
  if (!hold) return null;
  return hold.paused ? el("span", {class: "paused"}, "paused")
                     : el("span", {class: "held"}, "held " + dur(hold.held_s));
}

function counts(c, cls) {
  // A count, and under it the busiest keys of a keyed limit ("?": the workers not asked).
  if (c === null) return el("td", {class: "num " + cls}, "?");
  const cell = el("td", {class: "num " + cls}, c.total);
  for (const k of c.keys) cell.append(el("span", {class: "sub"}, k.key + ": " + k.count));
  if (c.more_keys) cell.append(el("span", {class: "sub"}, "+" + c.more_keys + " keys"));
  return cell;
}

function chart(name, history) {
  // Admitted per second (blue) against the rate in force (red, dashed), last minutes.
  const NS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const points = history.filter(h => h.admitted[name] !== null && h.admitted[name] !== undefined);
  const rates = history.map(h => h.rate[name]).filter(r => r !== null && r !== undefined);
  let top = Math.max(1e-9, ...points.map(h => h.admitted[name]), ...rates) * 1.15;
  if (history.length < 2) return svg;
  const t0 = history[0].t, t1 = history[history.length - 1].t;
  const x = t => (W - 2) * (t - t0) / Math.max(t1 - t0, 1e-9) + 1;
  const y = v => H - 2 - (H - 4) * v / top;
  const line = (cls, pts) => {
    if (pts.length < 2) return;
    const p = document.createElementNS(NS, "polyline");
    p.setAttribute("class", cls);
    p.setAttribute("points", pts.map(([t, v]) => x(t).toFixed(1) + "," + y(v).toFixed(1)).join(" "));
    svg.append(p);
  };
  line("limit", history.filter(h => h.rate[name] !== null && h.rate[name] !== undefined)
                       .map(h => [h.t, h.rate[name]]));
  line("admitted", points.map(h => [h.t, h.admitted[name]]));
  svg.setAttribute("data-points", String(points.length));
  return svg;
}

async function act(action, limit, button) {
  const message = document.getElementById("message");
  const token = document.getElementById("token").value;
  button.disabled = true;
  try {
    const answer = await fetch("api/" + action, {
      method: "POST",
      headers: {"Content-Type": "application/json", "Authorization": "Bearer " + token},
      body: JSON.stringify({limit: limit, key: null}),
    });
    const data = await answer.json();
    message.className = answer.ok ? "" : "bad";
    message.textContent = answer.ok ? `${action}d ${limit}` : data.error;
    if (answer.ok) sessionStorage.setItem("throttle-token", token);
  } catch (e) {
    message.className = "bad";
    message.textContent = String(e);
  } finally {
    button.disabled = false;
    refresh();
  }
}

// The keys listed per limit (rates set, holds): a fleet of thousands of tenants would make
// one row thousands of lines tall and push every other limit off the page; the rest is
// counted, and `celery throttle status --json` lists them all.
const KEYS_SHOWN = 5;

function more(cell, total, what, cls) {
  if (total > KEYS_SHOWN) {
    cell.append(el("span", {class: "sub " + cls}, "+" + (total - KEYS_SHOWN) + " more " + what +
      " (celery throttle status --json)"));
  }
}

function row(limit, history) {
  const tr = el("tr", {"data-limit": limit.name});
  let rate = limit.effective_rate;
  if (limit.learned_per_s !== null) rate = num(limit.learned_per_s) + "/s learned";
  const configured = el("td", {class: "configured"}, limit.rate + (limit.burst !== null ? " burst " + num(limit.burst) : ""));
  if (limit.override !== null) configured.append(el("span", {class: "sub"}, limit.override_ignored ? "set rate ignored (bad)" : "set at run time: " + limit.override));
  // A plan table: each plan's rate and burst (a fair limit's: its keys' weight).
  for (const [plan, p] of Object.entries(limit.plans || {})) {
    configured.append(el("span", {class: "sub plan", "data-plan": plan}, "plan " + plan + ": " +
      (p.weight !== undefined ? "weight " + num(p.weight) : p.rate + " burst " + num(p.burst))));
  }
  // Keys with a rate of their own, set at run time (celery throttle set LIMIT RATE --key KEY).
  const keyRates = Object.entries(limit.key_rates || {});
  for (const [key, spec] of keyRates.slice(0, KEYS_SHOWN)) {
    configured.append(el("span", {class: "sub key-rate", "data-key": key}, "key " + key + ": " + spec));
  }
  more(configured, keyRates.length, "keys set", "key-rates-more");
  const hold = el("td", {class: "hold"}, holdText(limit.hold) || "–");
  const keyHolds = Object.entries(limit.key_holds);
  for (const [key, h] of keyHolds.slice(0, KEYS_SHOWN)) {
    hold.append(el("span", {class: "sub"}, key + ": ", holdText(h)));
  }
  more(hold, keyHolds.length, "keys held", "key-holds-more");
  const per = limit.per_minute;
  const refused = el("td", {class: "num refused"}, num(per.denied));
  if (per.timeout) refused.append(el("span", {class: "sub"}, num(per.timeout) + " timed out"));
  if (per.parked) refused.append(el("span", {class: "sub"}, num(per.parked) + " parked"));
  const admitted = el("td", {class: "admitted"}, chart(limit.name, history),
    el("span", {class: "sub now"}, limit.admitted_per_s === null ? "–"
      : num(limit.admitted_per_s) + "/s" + (limit.admitted_source === "tokens" ? " (est. from tokens)" : "")));
  if (limit.rate_per_s !== null) admitted.append(el("span", {class: "sub"}, "limit " + num(limit.rate_per_s) + "/s"));
  const actions = el("td", {class: "actions"});
  if (control) {
    const paused = limit.hold && limit.hold.paused;
    const button = el("button", {class: paused ? "resume" : "pause", "data-limit": limit.name},
                      paused ? "resume" : "pause");
    button.addEventListener("click", () => act(paused ? "resume" : "pause", limit.name, button));
    actions.append(button);
  }
  const name = el("td", {class: "name"}, limit.name,
    el("span", {class: "sub"}, limit.algorithm + (limit.fair ? ", fair" : "") + (limit.key !== null ? ", key " + limit.key : "")));
  if (limit.mode === "shadow") name.append(el("span", {class: "sub mode shadowed"}, "shadow mode: delays nothing"));
  const seen = limit.shadow;
  if (seen && seen.tasks) {
    // What the limit, in shadow, would have done over the last minutes (counted from the send).
    name.append(el("span", {class: "sub shadow"}, (limit.mode === "shadow" ? "" : "enforced now; in shadow mode it ") +
      "would have delayed " + seen.delayed + " of " + seen.tasks +
      (seen.delayed ? ", p50 " + dur(seen.p50_s) + ", p95 " + dur(seen.p95_s) : "")));
  }
  // A full concurrency limit frees a unit when a running task ends: its next_slot_s is
  // only when its oldest lease would expire (a task that never ends), minutes away, so it
  // reads "on release", as `celery throttle status` says.
  const nextSlot = limit.key !== null ? "per key" : limit.next_slot_s === null ? "paused"
                   : limit.next_slot_s === 0 ? "now"
                   : limit.algorithm === "concurrency" ? "on release"
                   : "in " + dur(limit.next_slot_s);
  tr.append(
    name,
    el("td", {class: "rate"}, rate),
    configured,
    el("td", {class: "num tokens"}, limit.key !== null ? "per key" : num(limit.tokens)),
    el("td", {class: "slot"}, nextSlot),
    hold,
    el("td", {class: "num running"}, limit.in_flight === null ? "?" : limit.in_flight),
    counts(limit.waiting, "waiting"), counts(limit.parked, "parked"), refused, admitted, actions,
  );
  return tr;
}

function draw(data) {
  interval = Math.max(500, (data.interval_s || 2) * 1000);
  control = !!data.control;
  document.getElementById("control").hidden = !control;
  const error = document.getElementById("error");
  error.hidden = !data.error;
  error.textContent = data.error ? "Cannot read the fleet: " + data.error : "";
  if (data.taken) {
    const updated = document.getElementById("updated");
    updated.textContent = "updated " + new Date(data.taken * 1000).toLocaleTimeString();
    updated.dataset.taken = String(data.taken);
  }
  if (data.error || !data.limits) return;
  document.getElementById("where").textContent =
    `redis ${data.redis} · namespace ${data.namespace} · limits file ${data.config || "(none)"}`;
  const warning = document.getElementById("warning");
  warning.hidden = !data.evicts;
  warning.textContent = data.evicts
    ? `The limiter's Redis evicts keys when it is full (maxmemory-policy ${data.evicts}): ` +
      "a limit's state, a lease or a parked task can vanish. Set maxmemory-policy noeviction."
    : "";
  const body = document.querySelector("#limits tbody");
  body.replaceChildren(...data.limits.map(limit => row(limit, data.history || [])));
  document.getElementById("footer").textContent =
    `${data.parked} tasks parked in Redis, ${data.releasing} being released · ` +
    (data.workers === null ? "workers not asked" : `${data.workers} workers replied`) +
    ` · refused: deferred per minute over the last ${data.minutes} whole minutes` +
    ` · shadow: over the last ${data.minutes} minutes` +
    ` · chart: the last ${span(data.history || [])}`;
}

function span(history) {
  return history.length < 2 ? "–" : dur(history[history.length - 1].t - history[0].t);
}

let timer = null;
async function refresh() {
  clearTimeout(timer);
  try {
    const answer = await fetch("api/state", {cache: "no-store"});
    draw(await answer.json());
  } catch (e) {
    const error = document.getElementById("error");
    error.hidden = false;
    error.textContent = "The page's server does not answer: " + e;
  }
  timer = setTimeout(refresh, interval);
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("token").value = sessionStorage.getItem("throttle-token") || "";
  refresh();
});
