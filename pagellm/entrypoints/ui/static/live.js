// The live engine view: one snapshot stream (fetch + SSE, with the key), feeding the block grid,
// the counters, the charts and the request tables. Rates (tokens/s, hit rate) come from the
// differences of the server's cumulative counters between snapshots.

import { apiFetch, errorText, sseData } from "./api.js";
import { Chart } from "./charts.js";
import { BlockGrid, Palette, decodeCells, escapeHtml, shortId } from "./grid.js";

const RATE_WINDOW_S = 5; // rates are averaged over this many seconds of snapshots
const TABLE_CHIPS = 24; // block-table entries drawn per request

const ms = (v) => (v === null || v === undefined ? "–" : v < 1 ? `${(v * 1000).toFixed(0)} ms` : `${v.toFixed(2)} s`);
const pct = (v) => `${(v * 100).toFixed(0)}%`;

export class LiveView {
  constructor() {
    this.palette = new Palette();
    this.grid = new BlockGrid(document.getElementById("kv-grid"), document.getElementById("tooltip"), this.palette);
    this.replica = 0;
    this.history = []; // [{time, stats}] within RATE_WINDOW_S
    this.count = 0;
    this.generation = 0; // bumped to end the running stream (replica change)
    const charts = document.getElementById("charts");
    const blue = "#6aa9ff", orange = "#ffae57", green = "#6fdc8c", red = "#ff6b6b", violet = "#c792ea";
    this.charts = {
      queues: new Chart(charts, "requests", [
        { label: "running", colour: green }, { label: "waiting", colour: orange }], { format: (v) => v.toFixed(0) }),
      kv: new Chart(charts, "KV pool", [
        { label: "used", colour: blue }, { label: "shared", colour: violet }], { fixedMax: 1, format: pct }),
      tokens: new Chart(charts, "tokens/s", [
        { label: "in", colour: orange }, { label: "out", colour: green }], { format: (v) => v.toFixed(0) }),
      hits: new Chart(charts, "prefix-cache hit rate", [{ label: "hits", colour: violet }], { fixedMax: 1, format: pct }),
      ttft: new Chart(charts, "TTFT", [
        { label: "p50", colour: green }, { label: "p90", colour: orange }, { label: "p99", colour: red }], { format: ms }),
      tpot: new Chart(charts, "TPOT", [
        { label: "p50", colour: green }, { label: "p90", colour: orange }, { label: "p99", colour: red }], { format: ms }),
      preemptions: new Chart(charts, "preemptions/s", [{ label: "", colour: red }], { format: (v) => v.toFixed(1) }),
    };
    document.getElementById("replica").addEventListener("change", (event) => {
      this.replica = Number(event.target.value);
      this.history = [];
      this.generation++;
      this.start();
    });
  }

  setStatus(state, text) {
    const box = document.getElementById("status");
    box.dataset.state = state;
    document.getElementById("status-text").textContent = text;
  }

  // Keep one stream open (reconnecting after a second when it ends or fails).
  async start() {
    const generation = this.generation;
    while (generation === this.generation) {
      try {
        const response = await apiFetch(`/ui/api/events?replica=${this.replica}`);
        if (!response.ok) {
          this.setStatus("error", await errorText(response));
        } else {
          this.setStatus("live", "live");
          for await (const data of sseData(response)) {
            if (generation !== this.generation) return;
            await this.onEvent(JSON.parse(data));
          }
          this.setStatus("error", "disconnected");
        }
      } catch (error) {
        this.setStatus("error", "disconnected");
      }
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  }

  async onEvent(snap) {
    if (snap.error) {
      this.setStatus("error", snap.error);
      return;
    }
    this.setStatus("live", "live");
    const cells = await decodeCells(snap.cells, snap.pool.num_cells);
    this.palette.keep(snap.requests.map((r) => r.id));
    this.grid.update(snap, cells);
    this.showHeader(snap);
    this.showCharts(snap);
    this.showRequests(snap);
    this.count++;
    document.body.dataset.snapshots = String(this.count);
  }

  showHeader(snap) {
    document.getElementById("model").textContent = snap.model;
    const box = document.getElementById("replica-box");
    const select = document.getElementById("replica");
    if (snap.num_replicas > 1 && select.options.length !== snap.num_replicas) {
      select.innerHTML = Array.from({ length: snap.num_replicas }, (_, i) => `<option value="${i}">${i}</option>`).join("");
      select.value = String(snap.replica);
      box.hidden = false;
    }
    const pool = snap.pool, used = pool.num_blocks - pool.num_free;
    document.getElementById("pool-summary").textContent =
      `${pool.num_blocks} blocks of ${pool.block_size} tokens` +
      (pool.blocks_per_cell > 1 ? ` (${pool.blocks_per_cell} per cell)` : "") +
      ` · ${used} held · ${pool.num_shared} shared · ${pool.num_cached_free} cached-free · ${pool.num_free - pool.num_cached_free} empty` +
      (pool.disk_tier_capacity ? ` · disk tier ${pool.disk_tier_blocks} of ${pool.disk_tier_capacity} blocks` : "") +
      ` · snapshot ${(snap.build_seconds * 1000).toFixed(2)} ms`;
  }

  rates(snap) {
    const now = snap.time;
    this.history.push({ time: now, stats: snap.stats });
    while (this.history.length > 2 && now - this.history[1].time >= RATE_WINDOW_S) this.history.shift();
    const first = this.history[0];
    const dt = now - first.time;
    if (dt <= 0) return { tokensIn: null, tokensOut: null, hitRate: null, preemptions: null };
    const d = (name) => snap.stats[name] - first.stats[name];
    const queries = d("prefix_cache_queries");
    return {
      tokensIn: d("num_prompt_tokens") / dt,
      tokensOut: d("num_generated_tokens") / dt,
      hitRate: queries > 0 ? d("prefix_cache_hits") / queries : null,
      preemptions: d("num_preemptions") / dt,
    };
  }

  showCharts(snap) {
    const s = snap.stats, pool = snap.pool, lat = snap.latency;
    const r = this.rates(snap);
    const c = this.charts;
    c.queues.push([snap.queues.running, snap.queues.waiting]);
    c.kv.push([(pool.num_blocks - pool.num_free) / pool.num_blocks, pool.num_shared / pool.num_blocks]);
    c.tokens.push([r.tokensIn, r.tokensOut]);
    c.hits.push([r.hitRate]);
    c.ttft.push([lat.ttft.p50, lat.ttft.p90, lat.ttft.p99]);
    c.tpot.push([lat.tpot.p50, lat.tpot.p90, lat.tpot.p99]);
    c.preemptions.push([r.preemptions]);
    const overall = s.prefix_cache_queries > 0 ? pct(s.prefix_cache_hits / s.prefix_cache_queries) : "–";
    const counters = [
      ["running", snap.queues.running], ["waiting", snap.queues.waiting - snap.queues.preempted],
      ["preempted", snap.queues.preempted], ["KV used", pct(s.kv_cache_usage)], ["shared blocks", pool.num_shared],
      ["prefix hits", overall], ["tok/s in", r.tokensIn === null ? "–" : r.tokensIn.toFixed(0)],
      ["tok/s out", r.tokensOut === null ? "–" : r.tokensOut.toFixed(0)],
      ["TTFT p50", ms(lat.ttft.p50)], ["TPOT p50", ms(lat.tpot.p50)], ["preemptions", s.num_preemptions],
      ["requests done", s.num_finished_requests],
    ];
    if (s.spec_num_draft_tokens > 0) {  // speculative decoding: the share of drafts kept, tokens a verifying step made
      counters.push(["drafts accepted", pct(s.spec_num_accepted_tokens / s.spec_num_draft_tokens)],
                    ["tokens / verify", (1 + s.spec_num_accepted_tokens / s.spec_num_drafts).toFixed(2)]);
    }
    document.getElementById("counters").innerHTML = counters
      .map(([k, v]) => `<div class="counter"><span class="k">${k}</span><span class="v">${v}</span></div>`).join("");
  }

  showRequests(snap) {
    const q = snap.queues;
    document.getElementById("queues").innerHTML =
      `<span class="badge running">running ${q.running}</span><span class="badge waiting">waiting ${q.waiting - q.preempted}</span>` +
      `<span class="badge preempted">preempted ${q.preempted}</span>` + (q.forking ? `<span class="badge">forking ${q.forking}</span>` : "");
    const rows = snap.requests.map((r) => {
      const colour = this.palette.colour(r.id);
      const done = r.tokens > 0 ? (100 * r.computed) / r.tokens : 0;
      const chips = r.table.slice(0, TABLE_CHIPS).map((b, i) =>
        `<span class="blk${i < r.released ? " released" : ""}" title="logical ${i} → physical ${b}" style="border-color:${colour}">${b}</span>`).join("");
      const more = r.blocks > TABLE_CHIPS ? `<span class="muted"> +${r.blocks - TABLE_CHIPS}</span>` : "";
      return `<tr data-request="${escapeHtml(r.id)}" data-status="${r.status}">
        <td title="${escapeHtml(r.id)}"><span class="chip" style="background:${colour}"></span>${escapeHtml(shortId(r.id))}</td>
        <td><span class="badge ${r.status}">${r.status}</span>${r.priority ? `<span class="muted" title="priority (lower first)"> p${r.priority}</span>` : ""}</td>
        <td><div class="bar"><div style="width:${done.toFixed(1)}%;background:${colour}"></div></div>${r.computed} / ${r.tokens}</td>
        <td>${r.cached > 0 ? r.cached : "–"}</td><td>${r.preemptions || "–"}</td>
        <td class="table">${chips}${more}</td></tr>`;
    });
    document.getElementById("requests").innerHTML = rows.join("") || `<tr><td colspan="6" class="muted">no requests</td></tr>`;
    const total = q.running + q.waiting + q.forking;
    document.getElementById("requests-more").textContent =
      total > q.listed ? `${total - q.listed} more not listed (the snapshot lists the first ${q.listed})` : "";
  }
}
