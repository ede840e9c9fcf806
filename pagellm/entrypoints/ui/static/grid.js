// The KV block pool as a canvas grid: one cell per block (or per group of blocks in a big pool),
// coloured by the request holding it; shared blocks outlined, prefix-cached ones dotted.
// Hovering a cell shows its block, holders, token range and reference count.

export const OWNER_FREE = -1, OWNER_CACHED_FREE = -2, OWNER_UNLISTED = -3;

// A colour per request, kept while the request lives: hues handed out in order of first sight,
// spread by the golden angle so that neighbours in time differ clearly.
export class Palette {
  constructor() {
    this.colours = new Map();
    this.next = 0;
  }

  colour(id) {
    let colour = this.colours.get(id);
    if (!colour) {
      const hue = (this.next++ * 137.508 + 200) % 360;
      colour = `hsl(${hue.toFixed(0)}, 68%, ${this.next % 2 ? 60 : 52}%)`;
      this.colours.set(id, colour);
    }
    return colour;
  }

  // Forget requests that are gone (the map stays as small as the listed requests).
  keep(ids) {
    const live = new Set(ids);
    for (const id of this.colours.keys()) if (!live.has(id)) this.colours.delete(id);
  }
}

// The payload's cell arrays: zlib + base64 -> position Int32, owner Int16, ref Uint8, cached Uint8.
export async function decodeCells(cells, numCells) {
  const bytes = Uint8Array.from(atob(cells.data), (c) => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  const raw = new Uint8Array(await new Response(stream).arrayBuffer());
  const view = new DataView(raw.buffer);
  const position = new Int32Array(numCells), owner = new Int16Array(numCells);
  for (let i = 0; i < numCells; i++) {
    position[i] = view.getInt32(4 * i, true);
    owner[i] = view.getInt16(4 * numCells + 2 * i, true);
  }
  const ref = raw.slice(6 * numCells, 7 * numCells);
  const cached = raw.slice(7 * numCells, 8 * numCells);
  return { position, owner, ref, cached };
}

export class BlockGrid {
  constructor(canvas, tooltip, palette) {
    this.canvas = canvas;
    this.palette = palette;
    this.tooltip = tooltip;
    this.snapshot = null;
    this.cells = null;
    this.cell = 10;
    this.cols = 1;
    canvas.addEventListener("mousemove", (event) => this.hover(event));
    canvas.addEventListener("mouseleave", () => (this.tooltip.hidden = true));
    new ResizeObserver(() => this.draw()).observe(canvas.parentElement);
  }

  update(snapshot, cells) {
    this.snapshot = snapshot;
    this.cells = cells;
    let owned = 0, shared = 0, cachedFree = 0;
    for (let i = 0; i < cells.owner.length; i++) {
      const o = cells.owner[i];
      if (o >= 0 || o === OWNER_UNLISTED) owned++;
      else if (o === OWNER_CACHED_FREE) cachedFree++;
      if (cells.ref[i] > 1) shared++;
    }
    // For tests and scripts: what the grid shows now.
    Object.assign(this.canvas.dataset, { cells: cells.owner.length, owned, shared, cachedFree });
    this.draw();
  }

  layout() {
    const n = this.cells ? this.cells.owner.length : 0;
    const width = Math.max(100, this.canvas.parentElement.clientWidth);
    const maxHeight = 320;
    let cell = Math.floor(Math.sqrt((width * maxHeight) / Math.max(n, 1)));
    cell = Math.max(3, Math.min(22, cell));
    this.cell = cell;
    this.cols = Math.max(1, Math.floor(width / cell));
    return { width: this.cols * cell, height: Math.max(1, Math.ceil(n / this.cols)) * cell };
  }

  draw() {
    if (!this.cells) return;
    const { width, height } = this.layout();
    Object.assign(this.canvas.dataset, { cols: this.cols, cellSize: this.cell }); // where each cell is drawn
    const ratio = window.devicePixelRatio || 1;
    const canvas = this.canvas;
    canvas.style.width = width + "px";
    canvas.style.height = height + "px";
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const { owner, ref, cached } = this.cells;
    const requests = this.snapshot.requests;
    const colours = requests.map((r) => this.palette.colour(r.id));
    const size = this.cell, gap = size >= 6 ? 1 : 0, inner = size - gap;
    for (let i = 0; i < owner.length; i++) {
      const x = (i % this.cols) * size, y = Math.floor(i / this.cols) * size;
      const o = owner[i];
      ctx.fillStyle = o >= 0 ? colours[o] : o === OWNER_CACHED_FREE ? "#4b5a73" : o === OWNER_UNLISTED ? "#9aa3b2" : "#242a35";
      ctx.fillRect(x, y, inner, inner);
      if (ref[i] > 1 && inner >= 5) {
        ctx.strokeStyle = "#ffffff";
        ctx.lineWidth = Math.max(1, Math.floor(inner / 6));
        ctx.strokeRect(x + ctx.lineWidth / 2, y + ctx.lineWidth / 2, inner - ctx.lineWidth, inner - ctx.lineWidth);
      }
      if (cached[i] && inner >= 7) {
        ctx.fillStyle = o === OWNER_CACHED_FREE ? "#9fb3d6" : "rgba(0,0,0,0.55)";
        const d = Math.max(2, Math.floor(inner / 4));
        ctx.fillRect(x + inner - d - 1, y + 1, d, d);
      }
    }
  }

  hover(event) {
    if (!this.cells) return;
    const rect = this.canvas.getBoundingClientRect();
    const col = Math.floor((event.clientX - rect.left) / this.cell);
    const row = Math.floor((event.clientY - rect.top) / this.cell);
    const i = row * this.cols + col;
    if (col >= this.cols || i < 0 || i >= this.cells.owner.length) {
      this.tooltip.hidden = true;
      return;
    }
    this.tooltip.innerHTML = this.describe(i);
    this.tooltip.hidden = false;
    const box = this.canvas.parentElement.getBoundingClientRect();
    this.tooltip.style.left = Math.min(event.clientX - box.left + 14, box.width - 260) + "px";
    this.tooltip.style.top = event.clientY - box.top + 14 + "px";
  }

  describe(i) {
    const snap = this.snapshot, pool = snap.pool, per = pool.blocks_per_cell;
    const { owner, ref, cached, position } = this.cells;
    const first = i * per, last = Math.min(first + per, pool.num_blocks) - 1;
    const lines = [per > 1 ? `<b>blocks ${first}&ndash;${last}</b> (one cell of ${per})` : `<b>block ${first}</b>`];
    const o = owner[i];
    if (o === OWNER_FREE) lines.push("free");
    else if (o === OWNER_CACHED_FREE) lines.push("free, KV still in the prefix cache");
    else if (o === OWNER_UNLISTED) lines.push("held by a request beyond the listed ones");
    lines.push(`reference count ${ref[i]}${ref[i] > 1 ? " (shared)" : ""}${cached[i] ? ", in prefix cache" : ""}`);
    if (per === 1 && position[i] >= 0) {
      const start = position[i] * pool.block_size;
      lines.push(`tokens ${start}&ndash;${start + pool.block_size - 1} of its sequence (logical block ${position[i]})`);
    }
    if (per === 1) {
      const holders = snap.requests.filter((r) => r.table.includes(first));
      for (const r of holders.slice(0, 6)) {
        lines.push(`<span class="chip" style="background:${this.palette.colour(r.id)}"></span>${escapeHtml(shortId(r.id))} &middot; logical ${r.table.indexOf(first)}`);
      }
      if (holders.length > 6) lines.push(`&hellip; and ${holders.length - 6} more`);
    } else if (o >= 0) {
      lines.push(`<span class="chip" style="background:${this.palette.colour(snap.requests[o].id)}"></span>${escapeHtml(shortId(snap.requests[o].id))}`);
    }
    return lines.join("<br>");
  }
}

// Long request ids (chatcmpl-<32 hex>) shortened for tables and tooltips.
export function shortId(id) {
  return id.length > 22 ? id.slice(0, 12) + "…" + id.slice(-8) : id;
}

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
