// pagedserve admin page: each worker's step timeline. A worker's engine sends its running totals
// (steps, tokens computed, device seconds, host seconds per engine phase, steps whose prompts
// were held back) to the kvstore about
// once a second; the page keeps the last two different ones per worker and shows what happened
// between them: steps/s, tokens/s, per step the host milliseconds of each phase (a stacked bar)
// and the device milliseconds, and the last minute of them (a canvas). Used by admin.js.
"use strict";

window.PagedserveTimeline = (() => {
  // the engine's top-level phases, in step order (compute/loop/engine.py); the others are parts of one
  const PHASES = ["redis_in", "launch", "process", "kvstore", "redis_out"];
  const PART_OF = {
    plan: "launch", forward: "launch", draw: "launch", compile: "launch", wait: "process",
    kv_wait: "kvstore",
  };
  const COLORS = {
    redis_in: "#9aa6b8", launch: "#2f6fde", process: "#1f9d55", kvstore: "#e08a1e",
    redis_out: "#8e5bd6", device: "#17323f", other: "#c9ced8",
  };
  const HELP = {
    redis_in: "taking requests from Redis (an idle engine's wait for them is not a step)",
    launch: "planning the step and enqueueing its forward and sampling (plan · forward · draw)",
    process: "waiting for the device (wait), then the tokens' host work",
    kvstore: "the step's kvstore call: sending it, waiting for the reply (kv_wait), applying it",
    redis_out: "handing the output records to the publisher",
    device: "the step's device work, from CUDA events (not measured on CPU); it overlaps the host phases",
  };
  const HISTORY_S = 60;
  const STALE_S = 5; // no new totals for this long: the worker is stuck in a step, or gone
  const PX_PER_S = 5;

  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const fmtMs = (x) => (x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2));
  const fmtRate = (x) => (x >= 100 ? Math.round(x).toLocaleString("en-US") : x.toFixed(1));
  const total = (t) => Object.values(t.phase_s).reduce((a, b) => a + b, 0);
  const phaseOrder = (names) => [
    ...PHASES.filter((p) => names.includes(p)),
    ...names.filter((p) => !PHASES.includes(p) && !(p in PART_OF)).sort(),
  ];

  // What ran between two totals (a, b: {at, t}, t as the kvstore reports it).
  function between(a, b) {
    const steps = b.t.steps - a.t.steps;
    const dt = Math.max(b.at - a.at, 1e-3);
    const tokens = Math.max(0, b.t.tokens - a.t.tokens);
    const perStep = (s) => (steps > 0 ? (1e3 * Math.max(0, s)) / steps : 0);
    const ms = {};
    const parts = {};
    for (const [name, s] of Object.entries(b.t.phase_s)) {
      const value = perStep(s - (a.t.phase_s[name] || 0));
      if (name in PART_OF) (parts[PART_OF[name]] ||= {})[name] = value;
      else ms[name] = value;
    }
    const order = phaseOrder(Object.keys(ms));
    return {
      at: b.at, dt, steps, tokens, order, ms, parts,
      stepsPerS: steps / dt,
      tokensPerS: tokens / dt,
      hostMs: order.reduce((sum, p) => sum + ms[p], 0),
      deviceMs: perStep(b.t.device_s - a.t.device_s),
      // steps whose prompts waited for the worker's --prefill-interval (0 from older workers)
      held: Math.max(0, (b.t.held_steps || 0) - (a.t.held_steps || 0)),
      busy: tokens > 0, // steps that computed no token only waited for requests
    };
  }

  class WorkerTimeline {
    constructor(workerId) {
      this.workerId = workerId;
      this.last = null; // {at, t}: the newest totals
      this.window = null; // between() the two newest different totals
      this.lastBusy = null; // the newest window that computed tokens
      this.history = []; // windows of the last HISTORY_S
      this.age = 0;
      this.hasTotals = false;
      this.root = el("div", "timeline");
      this.root.dataset.worker = workerId;
      this.head = el("div", "tl-head");
      this.bars = el("div", "tl-bars");
      this.legend = el("div", "tl-legend");
      this.canvas = el("canvas", "tl-history");
      this.canvas.width = HISTORY_S * PX_PER_S;
      this.canvas.height = 48;
      const right = el("div", "tl-right");
      right.append(this.canvas, el("div", "tl-caption", `ms/step, last ${HISTORY_S} s`));
      this.root.append(this.head, this.bars, this.legend, right);
      this.drawn = undefined; // what the bars show (redrawn only when it changes: titles stay)
      this.root.dataset.phases = "0";
    }

    // One poll: the worker's row from /admin/overview (timeline, timeline_age_s); now in seconds.
    update(row, now) {
      const t = row.timeline;
      this.hasTotals = Boolean(t);
      this.age = row.timeline_age_s;
      this.device = row.device;
      if (!t) return;
      const sample = { at: now - row.timeline_age_s, t };
      const last = this.last;
      if (last && t.steps === last.t.steps && total(t) === total(last.t)) return; // the same totals
      this.last = sample;
      if (!last || t.steps < last.t.steps) { // the first totals, or the worker restarted
        this.window = null;
        return;
      }
      this.window = between(last, sample);
      if (this.window.busy) this.lastBusy = this.window;
      this.history.push(this.window);
      while (this.history.length && this.history[0].at < now - HISTORY_S - 5) this.history.shift();
    }

    // "waiting" (no two totals yet), "busy", "idle" (no token computed between the last two
    // totals) or "stale" (no new totals for STALE_S).
    get state() {
      if (!this.window) return "waiting";
      if (this.age > STALE_S) return "stale";
      return this.window.busy ? "busy" : "idle";
    }

    // The window the bars show: the current one when busy, else the last busy one (dimmed).
    get shown() {
      return this.state === "busy" ? this.window : this.lastBusy;
    }

    render(scaleMs, now) {
      const state = this.state;
      const shown = this.shown;
      const d = this.root.dataset;
      d.state = state;
      d.steps = String(shown ? shown.steps : 0);
      d.stepsPerS = shown ? shown.stepsPerS.toFixed(2) : "0";
      d.tokensPerS = shown ? shown.tokensPerS.toFixed(2) : "0";
      d.held = String(shown ? shown.held : 0);
      this.head.replaceChildren(...this.headline(state, shown, now));
      const key = shown && `${shown.at}|${scaleMs}|${state === "busy"}`;
      if (key !== this.drawn) {
        this.drawn = key;
        this.drawBars(shown, scaleMs, state !== "busy");
      }
      this.drawHistory(now);
    }

    headline(state, shown, now) {
      const badge = el("span", `tl-state tl-${state}`, state);
      const out = [badge];
      const text = (s) => out.push(document.createTextNode(s));
      if (!this.hasTotals) {
        text(" no totals from this worker yet");
      } else if (state === "waiting") {
        text(" the page needs a second set of totals (they come about once a second)");
      } else {
        if (state === "stale") text(` no new totals for ${this.age.toFixed(0)} s (a long step, or the worker is gone)`);
        if (state === "idle") {
          const waits = this.window.steps;
          text(` no token computed in the last ${this.window.dt.toFixed(1)} s` +
            (waits ? ` (${waits} steps waiting for requests)` : ""));
        }
        if (shown) {
          if (state !== "busy") text(` · last busy ${Math.max(0, now - shown.at).toFixed(0)} s ago:`);
          const rate = el("b", null, ` ${fmtRate(shown.stepsPerS)} steps/s`);
          out.push(rate);
          text(` · ${fmtRate(shown.tokensPerS)} tokens/s · ${fmtMs(shown.hostMs)} ms/step on the host`);
          if (shown.deviceMs > 0) text(` · ${fmtMs(shown.deviceMs)} ms/step on the device`);
          text(` · over ${shown.dt.toFixed(1)} s (${shown.steps} steps)`);
          if (shown.held > 0) text(` · prompts held back in ${shown.held} of them`);
        }
      }
      return out;
    }

    drawBars(shown, scaleMs, dim) {
      this.root.classList.toggle("tl-dim", dim);
      let segments = 0;
      if (!shown) {
        this.bars.replaceChildren();
        this.legend.replaceChildren();
        this.root.dataset.phases = "0";
        return;
      }
      const scale = Math.max(scaleMs, 1e-6);
      const track = (label, cls) => {
        const bar = el("div", `tl-bar ${cls}`);
        this.bars.append(el("span", "tl-label", label), bar);
        return bar;
      };
      this.bars.replaceChildren();
      const host = track("host", "host");
      for (const p of shown.order) {
        const value = shown.ms[p];
        if (value <= 0) continue;
        const seg = el("span", "tl-seg");
        seg.style.width = `${(100 * value) / scale}%`;
        seg.style.background = COLORS[p] || COLORS.other;
        seg.title = `${p}: ${fmtMs(value)} ms/step${partsText(shown.parts[p], " (", ")")}` +
          (HELP[p] ? `\n${HELP[p]}` : "");
        host.append(seg);
        segments++;
      }
      const device = track("device", "device");
      if (shown.deviceMs > 0) {
        const seg = el("span", "tl-seg");
        seg.style.width = `${(100 * shown.deviceMs) / scale}%`;
        seg.style.background = COLORS.device;
        seg.title = `device: ${fmtMs(shown.deviceMs)} ms/step\n${HELP.device}`;
        device.append(seg);
      } else {
        device.append(el("span", "tl-none", /cuda/i.test(this.device || "") ? "no device time" : "not measured on CPU"));
      }
      this.root.dataset.phases = String(segments);
      // the numbers, one item per phase, with their colour: the bars' legend
      const items = shown.order.map((p) => {
        const item = el("span", "tl-item");
        const sw = el("span", "swatch");
        sw.style.background = COLORS[p] || COLORS.other;
        item.title = HELP[p] || p;
        item.append(sw, `${p} `, el("b", null, fmtMs(shown.ms[p])), partsText(shown.parts[p], " (", ")"));
        return item;
      });
      const dev = el("span", "tl-item");
      const sw = el("span", "swatch");
      sw.style.background = COLORS.device;
      dev.title = HELP.device;
      dev.append(sw, "device ", el("b", null, shown.deviceMs > 0 ? fmtMs(shown.deviceMs) : "–"));
      this.legend.replaceChildren(el("span", "tl-unit", "ms/step:"), ...items, dev);
    }

    // One column per window of the last minute, its height the host ms/step stacked by phase
    // (a tick for the device's), a low grey one where the worker was idle, nothing before the
    // page's first totals.
    drawHistory(now) {
      const c = this.canvas;
      const ctx = c.getContext("2d");
      const W = c.width, H = c.height, base = H;
      ctx.fillStyle = "#eef1f6"; ctx.fillRect(0, 0, W, H);
      const recent = this.history.filter((w) => w.at > now - HISTORY_S);
      const busy = recent.filter((w) => w.busy);
      // the scale: the tallest column, or twice the median one when that is lower (a window with
      // a few slow steps, a burst's eager prefills): taller ones are cut, with a dark cap
      const heights = busy.map((w) => Math.max(w.hostMs, w.deviceMs)).sort((a, b) => a - b);
      const median = heights.length ? heights[Math.floor(heights.length / 2)] : 0;
      const peak = Math.max(1e-6, Math.min(heights[heights.length - 1] || 0, 2 * median));
      for (const w of recent) {
        const x1 = Math.round(W - (now - w.at) * PX_PER_S);
        const x0 = Math.max(0, Math.min(x1 - 2, Math.round(W - (now - w.at + w.dt) * PX_PER_S)));
        const width = Math.max(2, x1 - x0 - 1);
        if (!w.busy) { ctx.fillStyle = "#b8c2d0"; ctx.fillRect(x0, base - 3, width, 3); continue; }
        const top = base - 2;
        let y = base;
        for (const p of w.order) {
          const h = Math.min((top * w.ms[p]) / peak, y);
          ctx.fillStyle = COLORS[p] || COLORS.other;
          ctx.fillRect(x0, y - h, width, h);
          y -= h;
        }
        if (w.deviceMs > 0) {
          ctx.fillStyle = COLORS.device;
          ctx.fillRect(x0, Math.max(0, Math.round(base - (top * w.deviceMs) / peak)), width, 2);
        }
        if (Math.max(w.hostMs, w.deviceMs) > peak * 1.001) {
          ctx.fillStyle = "#1b2330";
          ctx.fillRect(x0, 0, width, 2);
        }
      }
      c.title = busy.length
        ? `host ms per step, stacked by phase (dark tick: device), each ~1 s window of the last ` +
          `${HISTORY_S} s; top of the strip ${fmtMs(peak)} ms (a dark cap: cut), ` +
          `tallest ${fmtMs(heights[heights.length - 1])} ms; low grey: idle`
        : `no step computed a token in the last ${HISTORY_S} s`;
    }
  }

  function partsText(parts, open, close) {
    if (!parts) return "";
    const items = Object.entries(parts).sort((a, b) => b[1] - a[1]);
    return `${open}${items.map(([k, v]) => `${k} ${fmtMs(v)}`).join(", ")}${close}`;
  }

  // The bars' common scale: the largest host or device ms/step the busy workers show (the idle
  // ones' last busy windows when none is busy).
  function scale(timelines) {
    const all = [...timelines];
    const busy = all.filter((tl) => tl.state === "busy");
    let top = 0;
    for (const tl of busy.length ? busy : all) {
      const w = tl.shown;
      if (w) top = Math.max(top, w.hostMs, w.deviceMs);
    }
    return top;
  }

  return { WorkerTimeline, scale, between, PHASES, COLORS };
})();
