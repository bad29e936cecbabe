// pagedserve admin page: which of the host's pools (GPUs) the block map shows, when the kvstore
// has several (/admin/cache's `pools`): a select beside the map's title, hidden with one pool;
// each option says the pool's device, workers, running and queued requests and the blocks
// copied into it from the other pools. Used by admin.js.
"use strict";

window.PagedservePools = (() => {
  class PoolChoice {
    constructor(label, select) {
      this.label = label;
      this.select = select;
      this.pool = 0;
      select.addEventListener("change", () => { this.pool = Number(select.value); });
    }

    // `pools`: /admin/cache's rows, in pool order
    update(pools) {
      const rows = pools || [];
      this.label.hidden = rows.length < 2;
      while (this.select.options.length > rows.length) this.select.remove(this.select.options.length - 1);
      rows.forEach((row, i) => {
        const text = `pool ${row.pool} · ${row.device} · ${row.workers.length} worker(s), ` +
          `${row.running} running, ${row.queued} queued, ${row.copied_in_blocks} blocks copied in ` +
          `(${row.loaded_in_blocks || 0} from other pools' CPU tiers)`;
        if (i >= this.select.options.length) this.select.add(new Option(text, String(row.pool)));
        else this.select.options[i].text = text;
      });
      if (this.pool >= rows.length) this.pool = 0;
      this.select.value = String(this.pool);
    }

    // the block map's URL of the chosen pool
    query() {
      return `pool=${this.pool}`;
    }
  }

  return { PoolChoice };
})();
