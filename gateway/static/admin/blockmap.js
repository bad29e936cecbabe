// pagedserve admin page: the block map of one pool drawn on a canvas with ImageData, one cell
// per block, or several blocks per cell when the blocks outnumber the pixels. Used by admin.js.
"use strict";

window.PagedserveBlockMap = (() => {
  const STATES = ["free", "running", "cached", "swapped", "demoted"];
  const COLORS = {
    free: [214, 220, 230], running: [47, 111, 222], cached: [31, 157, 85],
    swapped: [230, 126, 34], demoted: [142, 91, 214],
  };
  const LABELS = {
    free: "free", running: "in use (running)", cached: "cached prefix",
    swapped: "swapped out", demoted: "demoted prefix",
  };
  const MAX_HEIGHT = { gpu: 240, cpu: 130 };
  const CELL_SIZES = [14, 12, 10, 8, 6, 5, 4, 3, 2, 1];
  const PALETTE = STATES.map((s) => COLORS[s]);
  // little-endian RGBA as one 32-bit word (every browser's typed arrays are little-endian)
  const PALETTE32 = PALETTE.map(([r, g, b]) => ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0);

  class PoolMap {
    constructor(tier) {
      this.tier = tier;
      this.canvas = document.getElementById(`map-${tier}`);
      this.ctx = this.canvas.getContext("2d", { alpha: false });
      this.states = new Uint8Array(0);
      this.layout = null;
      this.image = null;
      this.mark = null; // cell outlined (hover or pinned)
    }

    plan(count) {
      const width = Math.max(60, Math.floor(this.canvas.parentElement.clientWidth));
      const maxHeight = MAX_HEIGHT[this.tier];
      for (const size of CELL_SIZES) {
        const cols = Math.floor(width / size);
        if (Math.ceil(count / cols) * size <= maxHeight) {
          return { size, cols, per: 1, cells: count, width, gap: size >= 5 ? 1 : 0 };
        }
      }
      // more blocks than pixels: several blocks per 2x2-pixel cell, so that a cell holding a few
      // blocks in use among many free ones is still a visible dot
      const cols = Math.floor(width / 2);
      const per = Math.ceil(count / (cols * Math.floor(maxHeight / 2)));
      return { size: 2, cols, per, cells: Math.ceil(count / per), width, gap: 0 };
    }

    draw(states) {
      const t0 = performance.now();
      this.states = states;
      const count = states.length;
      const counts = STATES.map(() => 0);
      for (let i = 0; i < count; i++) counts[states[i]]++;
      const lay = this.plan(count);
      const rows = Math.ceil(lay.cells / lay.cols);
      const w = count ? lay.cols * lay.size : 0;
      const h = rows * lay.size;
      const old = this.layout;
      if (!old || old.size !== lay.size || old.cols !== lay.cols || old.per !== lay.per ||
          this.canvas.height !== h || this.canvas.width !== w) {
        this.canvas.width = w;
        this.canvas.height = h;
        this.canvas.style.width = `${w}px`;
        this.canvas.style.height = `${h}px`;
        this.image = w && h ? this.ctx.createImageData(w, h) : null;
      }
      this.layout = lay;
      if (this.image) {
        const px = new Uint32Array(this.image.data.buffer);
        px.fill(0xffffffff);
        const { size, cols, per, gap } = lay;
        const inner = size - gap;
        for (let c = 0; c < lay.cells; c++) {
          let color;
          if (per === 1) {
            color = PALETTE32[states[c]];
          } else {
            // several blocks in one pixel: their colours mixed by share, the blocks that are not
            // free at least half of it (so that a few cached blocks among many free still show)
            let r = 0, g = 0, b = 0, used = 0;
            const first = c * per, end = Math.min(count, first + per);
            for (let i = first; i < end; i++) {
              const s = states[i];
              if (s) { const rgb = PALETTE[s]; r += rgb[0]; g += rgb[1]; b += rgb[2]; used++; }
            }
            if (!used) {
              color = PALETTE32[0];
            } else {
              const f = Math.max(used / (end - first), 0.5), free = PALETTE[0];
              const mix = (sum, j) => ((f * sum) / used + (1 - f) * free[j]) | 0;
              color = ((255 << 24) | (mix(b, 2) << 16) | (mix(g, 1) << 8) | mix(r, 0)) >>> 0;
            }
          }
          const x0 = (c % cols) * size;
          const y0 = Math.floor(c / cols) * size;
          for (let y = 0; y < inner; y++) {
            const row = (y0 + y) * w + x0;
            for (let x = 0; x < inner; x++) px[row + x] = color;
          }
        }
      }
      this.paint();
      const d = this.canvas.dataset;
      d.blocks = String(count);
      d.blocksPerCell = String(lay.per);
      STATES.forEach((s, i) => { d[s] = String(counts[i]); });
      d.renderMs = (performance.now() - t0).toFixed(2);
      d.frames = String(Number(d.frames || 0) + 1);
      return counts;
    }

    paint() {
      if (!this.image) return;
      this.ctx.putImageData(this.image, 0, 0);
      if (this.mark !== null && this.mark < this.layout.cells) {
        const { size, cols } = this.layout;
        const s = Math.max(size, 3);
        this.ctx.strokeStyle = "#111";
        this.ctx.lineWidth = 1;
        this.ctx.strokeRect((this.mark % cols) * size - 0.5, Math.floor(this.mark / cols) * size - 0.5,
          s + 1, s + 1);
      }
    }

    cellAt(event) {
      if (!this.layout || !this.image) return null;
      const rect = this.canvas.getBoundingClientRect();
      const x = Math.floor(((event.clientX - rect.left) * this.canvas.width) / rect.width / this.layout.size);
      const y = Math.floor(((event.clientY - rect.top) * this.canvas.height) / rect.height / this.layout.size);
      const cell = y * this.layout.cols + x;
      return x >= 0 && x < this.layout.cols && cell >= 0 && cell < this.layout.cells ? cell : null;
    }

    range(cell) {
      const first = cell * this.layout.per;
      return [first, Math.min(this.states.length, first + this.layout.per)];
    }
  }


  // the base64 of /admin/blocks as bytes
  function decode(b64) {
    const raw = atob(b64);
    const out = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
    return out;
  }

  return { STATES, COLORS, LABELS, PoolMap, decode };
})();
