// pagedserve admin page: logs in, polls the admin API once a second, draws the KV block pools
// (blockmap.js) and the workers' step timelines (steptimeline.js) and fills the tables. The
// token lives in sessionStorage and is sent only in the Authorization header, never in a URL.
// Plain JS, no build step, nothing from elsewhere.
"use strict";

(() => {
  const POLL_MS = 1000;
  const TOKEN_KEY = "pagedserve.admin.token";
  const { STATES, COLORS, LABELS, PoolMap, decode } = window.PagedserveBlockMap;
  const { WorkerTimeline, scale: timelineScale } = window.PagedserveTimeline;
  const HISTORY = 120; // worker samples kept (seconds)
  const fmt = new Intl.NumberFormat("en-US");
  const $ = (id) => document.getElementById(id);
  const n = (x) => fmt.format(x);
  const ms = (s) => (s === null || s === undefined ? "–" : (1000 * s).toFixed(1));

  let token = sessionStorage.getItem(TOKEN_KEY);
  let polling = false;
  let timer = null;
  const workerHistory = new Map(); // worker id -> sequences held, one sample per poll
  const workerRows = new Map(); // worker id -> {main, sub: its timeline's row, timeline}

  class AuthError extends Error {}

  async function api(path, withToken = token) {
    const response = await fetch(path, {
      headers: { Authorization: `Bearer ${withToken}` },
      cache: "no-store",
      credentials: "omit",
    });
    if (response.status === 401) throw new AuthError("wrong admin token");
    let body = null;
    try { body = await response.json(); } catch (_) { /* not JSON */ }
    if (!response.ok) {
      const message = (body && body.error && body.error.message) || response.statusText;
      const err = new Error(`${response.status}: ${message}`);
      err.status = response.status;
      throw err;
    }
    return body;
  }

  const maps = { gpu: new PoolMap("gpu"), cpu: new PoolMap("cpu") };
  let choice = null; // which pool the map shows (PagedservePools.PoolChoice), once loaded

  function showBlocks(body) {
    const t0 = performance.now();
    for (const tier of ["gpu", "cpu"]) {
      const counts = maps[tier].draw(decode(body[tier].map));
      const parts = [`${n(body[tier].blocks)} blocks`];
      STATES.forEach((s, i) => { if (counts[i]) parts.push(`${n(counts[i])} ${s}`); });
      $(`${tier}-summary`).textContent = parts.join(" · ");
    }
    const per = Math.max(maps.gpu.layout.per, maps.cpu.layout.per);
    $("map-note").textContent = per > 1
      ? `up to ${per} blocks per cell: colours mixed by share, a cell with any block not free ` +
        "at least half its colour" : "one cell per block";
    return performance.now() - t0;
  }

  function legend() {
    const ul = $("legend");
    for (const s of STATES) {
      const li = document.createElement("li");
      const sw = document.createElement("span");
      sw.className = "swatch";
      sw.style.background = `rgb(${COLORS[s].join(",")})`;
      li.append(sw, LABELS[s]);
      ul.append(li);
    }
  }

  // ------------------------------------------------------------------ hover and click
  let pinned = null; // {tier, cell}
  let hoverTimer = null;

  function describe(tier, cell, info) {
    const box = $("block-info");
    const map = maps[tier];
    const [first, end] = map.range(cell);
    box.replaceChildren();
    const head = document.createElement("div");
    if (end - first === 1) {
      head.textContent = `${tier.toUpperCase()} block ${first}: ${STATES[map.states[first]]}`;
    } else {
      const counts = STATES.map(() => 0);
      for (let i = first; i < end; i++) counts[map.states[i]]++;
      const mix = STATES.map((s, i) => (counts[i] ? `${counts[i]} ${s}` : "")).filter(Boolean);
      head.textContent = `${tier.toUpperCase()} blocks ${first}–${end - 1}: ${mix.join(", ")}`;
    }
    box.append(head);
    if (info) {
      const dl = document.createElement("dl");
      const rows = [
        ["block", `${info.tier} ${info.block} (${info.state})`],
        ["owners", info.owners.length ? info.owners.join(", ") : "none"],
        ["prefix", info.prefix_key ? `${info.prefix_key} · ${n(info.prefix_tokens)} tokens` : "none"],
        ["hits", n(info.hits)],
        ["other tier", info.other_tier_block === null ? "none" : `block ${info.other_tier_block}`],
      ];
      for (const [k, v] of rows) {
        const dt = document.createElement("dt"); dt.textContent = k;
        const dd = document.createElement("dd"); dd.textContent = v;
        dl.append(dt, dd);
      }
      box.append(dl);
    }
    box.dataset.pinned = String(pinned !== null);
  }

  async function inspect(tier, cell) {
    const map = maps[tier];
    const [first, end] = map.range(cell);
    let block = first; // in an aggregated cell, its first block that is not free
    for (let i = first; i < end; i++) if (map.states[i] !== 0) { block = i; break; }
    try {
      describe(tier, cell, await api(`/admin/blocks/${tier}/${block}?${choice.query()}`));
    } catch (err) {
      describe(tier, cell, null);
      if (err instanceof AuthError) logout(err.message);
    }
  }

  function setMark(tier, cell) {
    for (const t of ["gpu", "cpu"]) {
      maps[t].mark = t === tier ? cell : null;
      maps[t].paint();
    }
  }

  function wireMap(tier) {
    const canvas = maps[tier].canvas;
    canvas.addEventListener("mousemove", (event) => {
      if (pinned) return;
      const cell = maps[tier].cellAt(event);
      clearTimeout(hoverTimer);
      if (cell === null) return;
      setMark(tier, cell);
      describe(tier, cell, null);
      hoverTimer = setTimeout(() => inspect(tier, cell), 150);
    });
    canvas.addEventListener("click", (event) => {
      const cell = maps[tier].cellAt(event);
      clearTimeout(hoverTimer);
      pinned = cell === null || (pinned && pinned.tier === tier && pinned.cell === cell)
        ? null : { tier, cell };
      setMark(tier, pinned ? cell : null);
      if (pinned) inspect(tier, cell);
      else $("block-info").dataset.pinned = "false";
    });
  }

  // ------------------------------------------------------------------ tables
  function fillTable(id, rows, columns, empty) {
    const body = document.querySelector(`#${id} tbody`);
    const out = [];
    for (const row of rows) {
      const tr = document.createElement("tr");
      for (const [value, cls] of columns(row)) {
        const td = document.createElement("td");
        if (value instanceof Node) td.append(value); else td.textContent = value;
        if (cls) td.className = cls;
        tr.append(td);
      }
      out.push(tr);
    }
    if (!out.length) {
      const tr = document.createElement("tr");
      tr.className = "empty";
      const td = document.createElement("td");
      td.colSpan = document.querySelectorAll(`#${id} thead th`).length;
      td.textContent = empty;
      tr.append(td);
      out.push(tr);
    }
    body.replaceChildren(...out);
  }

  function tierBadge(tier) {
    const span = document.createElement("span");
    span.className = "tier";
    span.textContent = tier;
    span.style.background = `rgb(${(tier === "gpu" ? COLORS.cached : COLORS.demoted).join(",")})`;
    return span;
  }

  function spark(samples) {
    const canvas = document.createElement("canvas");
    canvas.className = "spark";
    canvas.width = HISTORY * 2; canvas.height = 22;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#eef1f6"; ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.fillStyle = "#b8c2d0"; ctx.fillRect(0, 21, canvas.width, 1); // the zero line
    const top = Math.max(1, ...samples.map((s) => s.sequences));
    samples.forEach((s, i) => {
      const x = canvas.width - 2 * (samples.length - i);
      const h = Math.max(s.sequences ? 2 : 0, Math.round((20 * s.sequences) / top));
      ctx.fillStyle = "#2f6fde";
      ctx.fillRect(x, 22 - h, 2, h);
      if (s.idle_s > 5) { ctx.fillStyle = "#c62828"; ctx.fillRect(x, 19, 2, 3); } // not heard from
    });
    canvas.title = `sequences held each second (peak ${top}); red: not heard from for 5 s`;
    return canvas;
  }

  // Which cost-model profile the kvstore prices this worker's recomputes by.
  function profileOrigin(o) {
    if (!o) return "–";
    const cut = o.skipped ? `, ${o.skipped} points past its budget extrapolated` : "";
    const when = new Date(o.measured_at * 1000).toLocaleString();
    if (o.source === "measured") return `measured at start-up (${o.measure_s.toFixed(1)} s${cut})`;
    if (o.source === "cached") return `from cache, measured ${when} (${o.measure_s.toFixed(1)} s${cut})`;
    return "prior: none measured (swap and load preferred)";
  }

  // One row per worker, and under it its step timeline (steptimeline.js), which stays the same
  // element from poll to poll (the bars are redrawn only when new totals came).
  function showWorkers(workers, profiles) {
    const now = Date.now();
    const ids = workers.map((w) => w.worker_id);
    for (const id of [...workerRows.keys()]) {
      if (!ids.includes(id)) { workerRows.delete(id); workerHistory.delete(id); }
    }
    for (const w of workers) {
      const h = workerHistory.get(w.worker_id) || [];
      h.push({ at: now, sequences: w.requests, idle_s: w.idle_s });
      while (h.length > HISTORY) h.shift();
      workerHistory.set(w.worker_id, h);
      let rows = workerRows.get(w.worker_id);
      if (!rows) {
        const timeline = new WorkerTimeline(w.worker_id);
        const sub = document.createElement("tr");
        sub.className = "timeline-row";
        const td = document.createElement("td");
        td.colSpan = document.querySelectorAll("#workers thead th").length;
        td.append(timeline.root);
        sub.append(td);
        rows = { main: null, sub, timeline };
        workerRows.set(w.worker_id, rows);
      }
      rows.timeline.update(w, now / 1000);
      const main = document.createElement("tr");
      main.className = "worker-row";
      main.dataset.worker = w.worker_id;
      const cells = [
        [w.worker_id, "mono"], [w.device], [w.pid, "num"], [`${w.idle_s.toFixed(1)} s ago`, "num"],
        [n(w.requests), "num"], [spark(h)], [profileOrigin(w.profile_origin)],
        [(profiles[w.worker_id] || []).slice(0, 6).map(([t, s]) => `${n(t)}→${ms(s)}`).join("  ") || "–"],
      ];
      for (const [value, cls] of cells) {
        const td = document.createElement("td");
        if (value instanceof Node) td.append(value); else td.textContent = value;
        if (cls) td.className = cls;
        main.append(td);
      }
      if (rows.main) rows.main.replaceWith(main);
      rows.main = main;
    }
    const top = timelineScale([...workerRows.values()].map((r) => r.timeline));
    for (const rows of workerRows.values()) rows.timeline.render(top, now / 1000);
    const body = document.querySelector("#workers tbody");
    const order = ids.flatMap((id) => [workerRows.get(id).main, workerRows.get(id).sub]);
    if (order.length !== body.children.length || order.some((tr, i) => body.children[i] !== tr)) {
      if (order.length) body.replaceChildren(...order);
      else fillTable("workers", [], () => [], "no worker registered");
    }
  }

  function showOverview(body) {
    const cache = body.cache;
    const pc = cache.prefix_cache;
    choice.update(cache.pools);
    const tier = cache.cpu_tier || { prefix_cache: false, hit_tokens: 0, counts: {}, demoted_blocks: 0 };
    $("hit-tokens").textContent = n(pc.hit_tokens);
    $("hit-tokens").dataset.value = String(pc.hit_tokens);
    $("hit-rate").textContent = `${(100 * pc.hit_rate).toFixed(1)} %`;
    $("lookups").textContent = n(pc.lookups);
    $("queried-tokens").textContent = n(pc.queried_tokens);
    $("hits-gpu").textContent = `${n(pc.hit_tokens - tier.hit_tokens)} tokens`;
    $("hits-cpu").textContent = `${n(tier.hit_tokens)} tokens`;
    $("cpu-tier").textContent = tier.prefix_cache
      ? `on · ${n(tier.demoted_blocks)} demoted blocks` : "off";
    const kv = (obj) => Object.entries(obj || {}).filter(([, v]) => v).map(([k, v]) => `${k} ${n(v)}`).join(", ") || "none";
    $("tier-counts").textContent = kv(tier.counts);
    $("miss-reasons").textContent = kv(pc.miss_reasons);
    $("queued").textContent = n(body.requests.queued);

    fillTable("prefixes", cache.top_prefixes, (r) => [
      [r.key, "mono"], [n(r.tokens), "num"], [n(r.hits), "num"], [tierBadge(r.tier)], [r.block, "num"],
    ], "no cached prefix yet");

    const cost = body.cost_model;
    const decisions = [...cost.decisions].reverse().slice(0, 30);
    fillTable("decisions", decisions, (d) => [
      [d.id, "num"], [d.at.toFixed(1), "num"], [d.kind || "preempt"], [d.req_id, "mono"], [d.mode],
      [d.reason], [n(d.blocks), "num"], [n(d.tokens), "num"], [ms(d.predicted_swap_s), "num"],
      [ms(d.predicted_recompute_s), "num"], [ms(d.actual_s), "num"],
    ], "no swap, recompute or load decision yet");
    $("decision-counts").textContent = `preemptions: ${kv(cost.preemptions)}`;

    const live = body.requests;
    showWorkers(live.workers, cost.prefill_profiles);

    $("request-count").textContent = `${live.requests.length} sequences`;
    fillTable("requests", live.requests.slice(0, 50), (r) => [
      [r.req_id, "mono"], [r.worker, "mono"], [r.status + (r.orphaned ? " (orphaned)" : "")],
      [n(r.tokens), "num"], [n(r.num_computed), "num"], [n(r.cached_tokens), "num"],
      [n(r.gpu_blocks), "num"], [n(r.cpu_blocks), "num"], [n(r.preemptions), "num"],
    ], "no live request");
  }

  // ------------------------------------------------------------------ polling and login
  function setStatus(state, text) {
    const el = $("status");
    el.dataset.state = state;
    el.textContent = text;
  }

  async function tick() {
    if (!polling) return;
    const t0 = performance.now();
    const [overview, blocks] = await Promise.allSettled([
      api("/admin/overview"), api(`/admin/blocks?${choice.query()}`),
    ]);
    if (!polling) return;
    const failed = [overview, blocks].find((r) => r.status === "rejected");
    if (failed && failed.reason instanceof AuthError) { logout("the token was rejected"); return; }
    if (overview.status === "fulfilled") showOverview(overview.value);
    if (blocks.status === "fulfilled") showBlocks(blocks.value);
    const took = performance.now() - t0;
    if (failed) setStatus("error", `error: ${failed.reason.message}`);
    else setStatus("live", `live · ${new Date().toLocaleTimeString()} · ${took.toFixed(0)} ms`);
    timer = setTimeout(tick, Math.max(0, POLL_MS - took));
  }

  function start() {
    $("login").hidden = true;
    $("dashboard").hidden = false;
    $("logout").hidden = false;
    polling = true;
    clearTimeout(timer);
    tick();
  }

  function stop() {
    polling = false;
    clearTimeout(timer);
  }

  function logout(message) {
    stop();
    token = null;
    sessionStorage.removeItem(TOKEN_KEY);
    $("dashboard").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    setStatus("idle", "not logged in");
    const err = $("login-error");
    err.hidden = !message;
    err.textContent = message || "";
  }

  async function login(candidate) {
    const err = $("login-error");
    err.hidden = true;
    setStatus("idle", "checking the token…");
    try {
      await api("/admin/overview?top=0", candidate);
    } catch (e) {
      if (e instanceof AuthError) { logout("Wrong admin token."); return; }
      if (e.status === 403) { logout("The admin API is disabled on this gateway (no PAGEDSERVE_ADMIN_TOKEN)."); return; }
      if (!e.status) { logout(`The gateway did not answer: ${e.message}`); return; }
      // any other error came after the token was accepted (e.g. the kvstore is down): go on
    }
    token = candidate;
    sessionStorage.setItem(TOKEN_KEY, candidate);
    start();
  }

  document.addEventListener("DOMContentLoaded", () => {
    legend();
    choice = new window.PagedservePools.PoolChoice($("pool-choice"), $("pool-select"));
    wireMap("gpu");
    wireMap("cpu");
    $("login").addEventListener("submit", (event) => {
      event.preventDefault();
      const input = $("token");
      const candidate = input.value.trim();
      input.value = "";
      if (candidate) login(candidate);
    });
    $("logout").addEventListener("click", () => logout(""));
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && pinned) { pinned = null; setMark(null, null); $("block-info").dataset.pinned = "false"; }
    });
    if (token) login(token);
  });

  // For tests and the console: draw a block map body (as /admin/blocks sends it) and stop or
  // restart polling.
  window.pagedserveAdmin = { showBlocks, stop, start: () => token && start(), maps, workerRows };
})();
