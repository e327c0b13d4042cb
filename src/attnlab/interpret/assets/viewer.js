// The attnlab inspector. Plain ES2017, no libraries. Everything is built with createElement +
// textContent: token text is never parsed as HTML.
//
// showInspector(source) draws every view from a *source* of data, an object with these methods
// (each may return a value or a Promise of it; the views await them):
//   info()                       title, text, note, tokens, labels, model, precision, layers
//                                [{name, heads, layer, causal}], has {steps, next, rollout, lens, roles,
//                                generation}
//   weights(row, i)              Float32Array T*S: the weights of head i (an index into layers[row].heads)
//   thumbnail(row, i, n)         Float32Array n*n: the same, max-pooled
//   steps(row, head)             the tutorials' steps of one head (q, k, v, scores, softcap, allowed, bias, weights,
//                                head_outputs, scale, T, S, hd) or null when the page does not hold them
//   nextTokens(pos, settings)    {ids, probs, approx, greedy} after {temperature, topK, topP}
//   rollout(fusion)              Float32Array T*T
//   lens(lo, hi)                 {rows, k, start, width, ids, probs, final}: positions start..start+width-1 (covering lo..hi-1)
//   roles()                      {kinds, L, H, scores: {kind: Float32Array L*H}, note}
//   generation()                 {prompt_length, tokens, settings, steps: [{token, position, key_start,
//                                key_index (the token of each key slot, -1 none), candidates, probs,
//                                token_prob, row(layer, head) -> Float32Array S}]}
//   label(id)                    the printable text of a token id
// The offline page (attnlab viz --out FILE.html, a trace in Jupyter) embeds its data as JSON in the
// script element with id "attn-data": EmbeddedSource reads it (the last lines of this file). The
// live page of `attnlab serve` has a script element with id "attn-live" instead (its configuration):
// LiveSource fetches the same JSON from the server's API, section by section as the views need it,
// and LiveApp redraws the inspector as the prompt is typed, streams generation and ablates heads.
// showAttention(data) draws embedded data directly.
//
// showInspector(source, opts) may be called again on the same page with a new source (a new prompt):
// opts.signal (an AbortSignal) removes the previous call's listeners, opts.state carries the reader's
// choices (view, layer, head, ...) over, opts.ablated (a Set of "layer.head") marks ablated heads and
// opts.onHeadClick(layer, head) receives clicks on heads while "Clicking a head ablates it" is chosen.
"use strict";

// ------------------------------------------------------------------------------------------------
// Arrays of the page: binary, optionally quantized (u8/u16 = q / 255 or q / 65535), causal matrices
// as lower triangles (see attnlab/interpret/codec.py).
// ------------------------------------------------------------------------------------------------
const QMAX = { u8: 255, u16: 65535 };
const TYPED = { f32: Float32Array, i32: Int32Array, u16: Uint16Array, u8: Uint8Array };

function base64Bytes(text) {
  const bin = atob(text), out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

async function inflate(bytes) {
  if (typeof DecompressionStream === "undefined")
    throw new Error("this browser cannot read the page's data (it has no DecompressionStream)");
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Response(stream).arrayBuffer();
}

class PackedArray {
  constructor(desc, blob) {
    this.shape = desc.shape;
    this.tri = !!desc.tri;
    this.q = QMAX[desc.dtype] || 0;
    let buffer, offset, nbytes;
    if (desc.ref) {
      buffer = blob; offset = desc.ref[0]; nbytes = desc.ref[1];
    } else {
      const bytes = base64Bytes(desc.b64);
      buffer = bytes.buffer; offset = 0; nbytes = bytes.length;
    }
    const Typed = TYPED[desc.dtype];
    this.raw = new Typed(buffer, offset, nbytes / Typed.BYTES_PER_ELEMENT);
    const n = this.shape.length;
    this.rows = n >= 2 ? this.shape[n - 2] : 1;
    this.cols = this.shape[n - 1];
    this.per = this.tri ? (this.rows * (this.rows + 1)) / 2 : this.rows * this.cols;  // stored per matrix
  }
  at(i) { return this.q ? this.raw[i] / this.q : this.raw[i]; }
  // The k-th matrix (rows x cols) as a full Float32Array (zeros above the diagonal when packed).
  matrix(k) {
    const R = this.rows, C = this.cols, out = new Float32Array(R * C), base = k * this.per, q = this.q;
    if (!this.tri) {
      for (let i = 0; i < R * C; i++) out[i] = q ? this.raw[base + i] / q : this.raw[base + i];
      return out;
    }
    let p = base;
    for (let i = 0; i < R; i++) for (let j = 0; j <= i; j++, p++) out[i * C + j] = q ? this.raw[p] / q : this.raw[p];
    return out;
  }
  // The k-th matrix max-pooled to n x n, without expanding it.
  pooled(k, n) {
    const R = this.rows, C = this.cols, out = new Float32Array(n * n), base = k * this.per, q = this.q || 1;
    const ri = new Int32Array(R), ci = new Int32Array(C);
    for (let i = 0; i < R; i++) ri[i] = Math.min(n - 1, Math.floor((i * n) / R)) * n;
    for (let j = 0; j < C; j++) ci[j] = Math.min(n - 1, Math.floor((j * n) / C));
    let p = base;
    for (let i = 0; i < R; i++) {
      const r = ri[i], end = this.tri ? i + 1 : C;
      for (let j = 0; j < end; j++, p++) {
        const v = this.raw[p], c = r + ci[j];
        if (v > out[c]) out[c] = v;
      }
    }
    if (q !== 1) for (let i = 0; i < out.length; i++) out[i] /= q;
    return out;
  }
  all() {  // every stored value, dequantized (small arrays)
    const out = new Float32Array(this.raw.length);
    for (let i = 0; i < out.length; i++) out[i] = this.at(i);
    return out;
  }
}

// ------------------------------------------------------------------------------------------------
// The data source of an offline page: everything embedded.
// ------------------------------------------------------------------------------------------------
class EmbeddedSource {
  constructor(data) {
    this.data = data;
    this.blob = null;
    this.cache = new Map();
  }
  async open() {
    if (this.data.blob) this.blob = await inflate(base64Bytes(this.data.blob.b64));
    return this;
  }
  arr(desc) {
    if (!this.cache.has(desc)) this.cache.set(desc, new PackedArray(desc, this.blob));
    return this.cache.get(desc);
  }
  info() {
    const d = this.data;
    return {
      title: d.title, text: d.text, note: d.note, tokens: d.tokens, labels: d.labels, model: d.model,
      precision: d.precision || null,
      layers: d.layers.map((l, r) => ({ name: l.name, heads: l.heads, layer: l.layer === undefined ? r : l.layer,
                                         causal: l.causal })),
      has: { steps: !!d.steps, next: !!d.next, rollout: !!d.rollout, lens: !!d.lens, roles: !!d.roles,
             generation: !!(d.generation && d.generation.steps.length) },
      stepsHint: d.steps ? d.steps.hint : "",
      stepHeads: d.steps ? d.steps.heads.map((h) => ({ row: h.row, head: h.head })) : [],
      // The temperatures this page holds probabilities for (0 = greedy); a live source omits it.
      temperatures: d.next ? [0].concat(d.next.temperatures) : null,
    };
  }
  weights(row, i) { return this.arr(this.data.layers[row].weights).matrix(i); }
  thumbnail(row, i, n) { return this.arr(this.data.layers[row].weights).pooled(i, n); }
  steps(row, head) {
    const s = this.data.steps && this.data.steps.heads.find((h) => h.row === row && h.head === head);
    if (!s) return null;
    const get = (name) => (s[name] ? this.arr(s[name]) : null);
    const q = get("q"), k = get("k"), scores = get("scores");
    return {
      name: s.name, scale: s.scale, softcap: s.softcap || null, T: scores.rows, S: scores.cols, hd: q.cols,
      q: q.matrix(0), k: k.matrix(0), v: get("v").matrix(0), scores: scores.matrix(0),
      allowed: get("allowed").matrix(0), bias: s.bias ? get("bias").matrix(0) : null,
      weights: get("weights").matrix(0), head_outputs: get("head_outputs").matrix(0),
      names: Object.assign({}, this.data.steps.names, s.names || {}),
    };
  }
  nextTokens(pos, settings) {
    const n = this.data.next, N = n.k, ids = this.arr(n.ids), probs = this.arr(n.probs);
    const out = { ids: [], probs: [], approx: false, greedy: false };
    for (let i = 0; i < N; i++) out.ids.push(ids.raw[pos * N + i]);
    if (!(settings.temperature > 0)) {  // greedy: the argmax, with probability 1
      out.greedy = true;
      out.probs = out.ids.map((_, i) => (i === 0 ? 1 : 0));
      return out;
    }
    // The stored distribution: temperature applied by the library (SamplingConfig.probabilities),
    // at each temperature the page offers; top-k and top-p then filter and renormalise it, in the
    // order and with the rules of SamplingConfig.filter.
    const temps = n.temperatures;
    let t = 0;
    for (let i = 1; i < temps.length; i++)
      if (Math.abs(temps[i] - settings.temperature) < Math.abs(temps[t] - settings.temperature)) t = i;
    const T = this.data.tokens.length;
    let p = [];
    for (let i = 0; i < N; i++) p.push(probs.raw[(t * T + pos) * N + i]);
    let keep = N, mass = null;
    const V = n.vocab_size;
    if (settings.topK && settings.topK < V) {
      if (settings.topK <= N) {
        const kth = p[settings.topK - 1];
        keep = 0;
        while (keep < N && p[keep] >= kth) keep++;  // ties with the k-th are kept, as logits >= kth
        mass = 0;
        for (let i = 0; i < keep; i++) mass += p[i];
      } else out.approx = true;
    }
    if (mass !== null) p = p.map((x, i) => (i < keep ? x / mass : 0));
    if (settings.topP < 1) {
      let cum = 0, m = 0;
      while (m < keep && cum < settings.topP) { cum += p[m]; m++; }  // keep while the mass before < top_p
      if (cum < settings.topP && keep === N && mass === null) { out.approx = true; cum = settings.topP; }
      p = p.map((x, i) => (i < m ? x / cum : 0));
    } else if (mass === null) {
      for (let i = keep; i < N; i++) p[i] = 0;
    }
    out.probs = p;
    return out;
  }
  rollout(fusion) { return this.arr(this.data.rollout[fusion]).matrix(0); }
  lens(lo, hi) {  // positions [lo, hi) are asked for; an offline page holds them all (start 0)
    const l = this.data.lens, ids = this.arr(l.ids);
    return { rows: l.rows, k: l.k, start: l.start || 0, width: ids.shape[1], ids: ids.raw,
             probs: this.arr(l.probs).all(), final: this.arr(l.final_probs).all() };
  }
  roles() {
    const r = this.data.roles, first = this.arr(r.scores[r.kinds[0]]);
    const scores = {};
    for (const kind of r.kinds) scores[kind] = this.arr(r.scores[kind]).all();
    return { kinds: r.kinds, L: first.rows, H: first.cols, scores: scores, note: r.note };
  }
  generation() {
    const g = this.data.generation;
    return {
      prompt_length: g.prompt_length, tokens: g.tokens, settings: g.settings,
      steps: g.steps.map((s) => playbackStep(s, this.arr(s.weights))),
    };
  }
  label(id) {
    const v = this.data.vocab || {};
    return v[String(id)] !== undefined ? v[String(id)] : "#" + id;
  }
}

// One generated token as the generation view plays it: s as inspector.generation_step_data writes it,
// w its packed weights (L, H, S).
function playbackStep(s, w) {
  const H = w.shape[1], S = w.shape[2];
  return {
    token: s.token, position: s.position, key_start: s.key_start, key_index: s.key_index,
    candidates: s.candidates, probs: s.probs, token_prob: s.token_prob, S: S, H: H,
    row: (layer, head) => { const out = new Float32Array(S); for (let j = 0; j < S; j++)
      out[j] = w.at((layer * H + head) * S + j); return out; },
  };
}

// ------------------------------------------------------------------------------------------------
// Colours
// ------------------------------------------------------------------------------------------------
// White -> yellow -> orange -> red -> plum: a sequential scale readable in print and for most
// colour-blind viewers; t in [0, 1].
const STOPS = [[255, 255, 255], [254, 227, 145], [246, 134, 56], [190, 40, 40], [90, 10, 60]];
function colour(t) {
  t = Math.min(1, Math.max(0, t || 0)) * (STOPS.length - 1);
  const i = Math.min(STOPS.length - 2, Math.floor(t)), f = t - i;
  const a = STOPS[i], b = STOPS[i + 1];
  return [0, 1, 2].map((k) => Math.round(a[k] + (b[k] - a[k]) * f));
}
const LUT = Array.from({ length: 256 }, (_, i) => colour(i / 255));
const seqRGB = (t) => LUT[Math.round(Math.min(1, Math.max(0, t || 0)) * 255)];
// Scores: blue below zero, white at zero, red above; masked (-inf) grey.
function divRGB(t) {
  if (t === -Infinity) return [201, 206, 214];
  t = Math.max(-1, Math.min(1, t || 0));
  const far = t < 0 ? [59, 91, 219] : [201, 42, 42], f = Math.abs(t);
  return [0, 1, 2].map((k) => Math.round(255 + (far[k] - 255) * f));
}
const css = (rgb) => "rgb(" + rgb.join(", ") + ")";
const dark = (rgb) => 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 140;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
const prob = (p) => (p > 0 && p < 0.001 ? p.toExponential(2) : p.toFixed(4));
// The top-k box's value: 0 = off; a k past every vocabulary keeps every token, as 0 does
// (the server takes at most 2^20).
const topK = (input) => Math.min(1 << 20, Math.max(0, Math.floor(Number(input.value) || 0)));
function fmt(v, digits) {
  if (v === -Infinity) return "-inf";
  if (v === Infinity) return "inf";
  return v.toFixed(digits);
}

// ------------------------------------------------------------------------------------------------
// A heatmap: a grid of DOM cells for small matrices (each cell has data-<key>, a title and, when
// the cells are big enough, its number), a canvas beyond DOM_LIMIT cells (hover reads the value).
// ------------------------------------------------------------------------------------------------
const DOM_LIMIT = 96 * 96;

class Heatmap {
  constructor(box, o) {
    this.box = box; this.o = o; this.R = o.rows; this.C = o.cols;
    box.textContent = "";
    const cell = o.cellPx || Math.max(1, Math.min(34, Math.floor((o.width || 700) / Math.max(this.C, 1))));
    this.cellPx = cell;
    this.dom = this.R * this.C <= DOM_LIMIT;
    box.classList.toggle("canvas", !this.dom);
    if (this.dom) this.buildGrid(cell); else this.buildCanvas(cell);
  }
  buildGrid(cell) {
    const o = this.o, box = this.box;
    const labels = cell >= 7;  // below 7 px a label could not be read: cell titles name the tokens
    box.style.setProperty("--cell", cell + "px");
    box.style.fontSize = Math.min(12, cell - 1) + "px";
    this.numbers = o.numbers !== undefined ? o.numbers && cell >= 24 : cell >= 30;
    box.style.gridTemplateColumns = "auto repeat(" + this.C + ", " + cell + "px)";
    this.cells = []; this.rowLabs = []; this.colLabs = [];
    box.appendChild(el("div", "corner", ""));
    for (let j = 0; j < this.C; j++) {
      const c = el("div", "lab clab", labels ? o.colLabel(j) : "");
      this.colLabs.push(c); box.appendChild(c);
    }
    for (let i = 0; i < this.R; i++) {
      const r = el("div", "lab rlab", labels ? o.rowLabel(i) : "");
      this.rowLabs.push(r); box.appendChild(r);
      const row = [];
      for (let j = 0; j < this.C; j++) {
        const c = el("div", "cell", "");
        c.dataset.q = String(i); c.dataset.k = String(j);
        if (o.onHover) c.addEventListener("mouseenter", () => o.onHover(i, j));
        row.push(c); box.appendChild(c);
      }
      this.cells.push(row);
    }
  }
  buildCanvas(cell) {
    const cv = document.createElement("canvas");
    cv.width = this.C; cv.height = this.R;
    cv.style.width = this.C * cell + "px"; cv.style.height = this.R * cell + "px";
    this.canvas = cv; this.ctx = cv.getContext("2d"); this.img = this.ctx.createImageData(this.C, this.R);
    const o = this.o;
    cv.addEventListener("mousemove", (e) => {
      const rect = cv.getBoundingClientRect();
      const j = Math.min(this.C - 1, Math.max(0, Math.floor(((e.clientX - rect.left) / rect.width) * this.C)));
      const i = Math.min(this.R - 1, Math.max(0, Math.floor(((e.clientY - rect.top) / rect.height) * this.R)));
      cv.dataset.q = String(i); cv.dataset.k = String(j);
      if (this.values) cv.dataset[o.key || "value"] = fmt(this.values[i * this.C + j], o.digits || 4);
      if (o.onHover) o.onHover(i, j);
    });
    this.box.appendChild(cv);
  }
  // values: Float32Array R*C; rgb(v) -> [r, g, b]; title(i, j, v) -> cell title.
  draw(values, rgb, title) {
    this.values = values;
    const o = this.o, key = o.key || "value", digits = o.digits || 4;
    if (!this.dom) {
      const d = this.img.data;
      for (let p = 0; p < this.R * this.C; p++) {
        const c = rgb(values[p]);
        d[4 * p] = c[0]; d[4 * p + 1] = c[1]; d[4 * p + 2] = c[2]; d[4 * p + 3] = 255;
      }
      this.ctx.putImageData(this.img, 0, 0);
      return;
    }
    for (let i = 0; i < this.R; i++) for (let j = 0; j < this.C; j++) {
      const c = this.cells[i][j], v = values[i * this.C + j], col = rgb(v);
      c.style.backgroundColor = css(col);
      c.dataset[key] = fmt(v, digits);
      if (this.numbers) {
        c.textContent = fmt(v, 2);
        c.style.color = dark(col) ? "white" : "#333";
      }
      c.title = title(i, j, v);
    }
  }
  // Outline query row (dir "row") or key column (dir "col") q; DOM grids only.
  path(q, dir) {
    if (!this.dom) return;
    for (let i = 0; i < this.R; i++) {
      this.rowLabs[i].classList.toggle("active", dir === "row" && i === q);
      for (let j = 0; j < this.C; j++)
        this.cells[i][j].classList.toggle("on-path", q !== null && (dir === "row" ? i === q : j === q));
    }
    for (let j = 0; j < this.C; j++) this.colLabs[j].classList.toggle("active", dir === "col" && j === q);
  }
}

// ------------------------------------------------------------------------------------------------
// The inspector
// ------------------------------------------------------------------------------------------------
async function showInspector(source, opts) {
  opts = opts || {};
  const $ = (id) => document.getElementById(id);
  // Listeners on the page's fixed elements go away when opts.signal aborts (a live page redraws).
  const on = (target, type, fn) => target.addEventListener(type, fn, opts.signal ? { signal: opts.signal } : undefined);
  const info = await source.info();
  const T = info.tokens.length, labels = info.labels, layers = info.layers;
  const state = Object.assign({ row: 0, hi: 0, query: null, pinned: null, dir: "row", stretch: false, view: "heads",
                                temperature: 1, topK: 0, topP: 1, fusion: "mean", role: null, gen: 0,
                                genMean: false }, opts.state || {});
  state.row = Math.min(state.row, layers.length - 1);
  state.hi = Math.min(state.hi, layers[state.row].heads.length - 1);
  const ablated = opts.ablated || new Set();
  const headClick = (layer, head, fallback) => {  // the live page's "Clicking a head ablates it"
    const mode = document.querySelector('input[name="click"]:checked');
    if (opts.onHeadClick && mode && mode.value === "ablate") opts.onHeadClick(layer, head);
    else fallback();
  };
  const built = {};
  const gone = () => !!(opts.signal && opts.signal.aborted);  // a newer inspector (a new prompt) has the page
  // A view's draw that awaits (a live source, token labels) claims the view first; stale() then says
  // whether a newer draw of it (or a newer inspector) began meanwhile, when it must not write.
  const claim = (view) => {
    const ticket = (view.ticket = (view.ticket || 0) + 1);
    return () => ticket !== view.ticket || gone();
  };
  let W = null;  // the selected head's weights, T*T

  $("title").textContent = info.title || info.text;
  $("note").textContent = info.note;
  document.title = (info.title || "attention") + " · attnlab";
  const precision = { f32: "float32 (exact)", u16: "16 bits (within 0.00001)", u8: "8 bits (within 0.002)" };
  $("status").textContent = info.precision ? "Attention weights stored as " + precision[info.precision] + "." : "";

  // ---- selects
  const layerSel = $("layer-select"), headSel = $("head-select");
  layerSel.textContent = "";
  layers.forEach((layer, i) => layerSel.appendChild(new Option(layer.name, String(i))));
  function fillHeads() {
    headSel.textContent = "";
    layers[state.row].heads.forEach((h, i) => headSel.appendChild(new Option("head " + h, String(i))));
    headSel.value = String(state.hi);
  }
  const headNumber = () => layers[state.row].heads[state.hi];
  const headName = () => layers[state.row].name + " \u00b7 head " + headNumber();

  // ---- token strip (shared by the views)
  const tokBox = $("tokens"), tokEls = [];
  tokBox.textContent = "";
  labels.forEach((label, i) => {
    const t = el("span", "tok", label);
    t.tabIndex = 0;
    t.dataset.index = String(i);
    t.title = JSON.stringify(info.tokens[i]);
    const w = el("span", "w", "");
    t.appendChild(w);
    t.addEventListener("mouseenter", () => setQuery(i));
    t.addEventListener("focus", () => setQuery(i));
    t.addEventListener("click", () => { state.pinned = state.pinned === i ? null : i; setQuery(i, true); });
    tokBox.appendChild(t);
    tokEls.push({ tok: t, w: w });
  });
  // Paint the strip: values[j] in [0, 1] (null: nothing highlighted); text[j] under each token.
  function paintStrip(values, scale, digits) {
    for (let j = 0; j < T; j++) {
      const { tok, w: wl } = tokEls[j];
      tok.classList.toggle("active", j === state.query);
      tok.classList.toggle("pinned", j === state.pinned);
      if (values === null) {
        tok.style.backgroundColor = "rgb(255, 255, 255)"; tok.style.color = ""; tok.dataset.weight = "";
        wl.textContent = "";
        continue;
      }
      const v = values[j], col = seqRGB(v / scale);
      tok.style.backgroundColor = css(col);
      tok.style.color = v / scale > 0.6 ? "white" : "";
      tok.dataset.weight = v.toFixed(4);
      wl.textContent = v.toFixed(digits || 2);
    }
  }
  function setQuery(i, force) {
    if (state.pinned !== null && !force) return;
    state.query = i;
    redraw("query");
  }
  function rowOf(m, q, dir) {  // row q (dir "row") or column q of a T*T matrix
    const out = new Float32Array(T);
    for (let j = 0; j < T; j++) out[j] = dir === "row" ? m[q * T + j] : m[j * T + q];
    return out;
  }

  // ---- views ------------------------------------------------------------------------------------
  const views = {};

  // (1) Heads: the selected head's matrix, and every head as a thumbnail.
  views.heads = {
    build() {
      this.map = new Heatmap($("matrix"), {
        rows: T, cols: T, key: "weight", rowLabel: (i) => labels[i], colLabel: (j) => labels[j],
        onHover: (i, j) => {
          setQuery(state.dir === "row" ? i : j);
          $("matrix-readout").textContent = labels[i] + " \u2192 " + labels[j] + ": " + W[i * T + j].toFixed(4);
        },
      });
      const thumbs = $("thumbs"), n = Math.min(T, 64);
      thumbs.textContent = "";
      this.thumbEls = [];
      const nCols = Math.max(...layers.map((l) => l.heads.length));
      thumbs.style.gridTemplateColumns = "auto repeat(" + nCols + ", auto)";
      layers.forEach((layer, li) => {
        thumbs.appendChild(el("div", "rowname", layer.name));
        const row = [];
        layer.heads.forEach((h, hi) => {
          const b = el("button", "thumb", "");
          b.type = "button";
          b.dataset.layer = String(li); b.dataset.head = String(hi);
          b.title = layer.name + " \u00b7 head " + h;
          const cv = document.createElement("canvas");
          cv.width = n; cv.height = n;
          b.appendChild(cv);
          b.appendChild(el("span", "", "head " + h));
          b.addEventListener("click", () => headClick(layer.layer, h, () => select(li, hi)));
          b.classList.toggle("ablated", ablated.has(layer.layer + "." + h));
          row.push({ button: b, canvas: cv }); thumbs.appendChild(b);
        });
        for (let k = layer.heads.length; k < nCols; k++) thumbs.appendChild(el("div", "", ""));
        this.thumbEls.push(row);
      });
      this.thumbsDrawn = false;
    },
    async drawThumbs() {
      const n = Math.min(T, 64);
      for (let li = 0; li < layers.length; li++) for (let hi = 0; hi < layers[li].heads.length; hi++) {
        const w = await source.thumbnail(li, hi, n), cv = this.thumbEls[li][hi].canvas;
        const ctx = cv.getContext("2d"), img = ctx.createImageData(n, n);
        for (let p = 0; p < n * n; p++) {
          const c = seqRGB(w[p]);
          img.data[4 * p] = c[0]; img.data[4 * p + 1] = c[1]; img.data[4 * p + 2] = c[2]; img.data[4 * p + 3] = 255;
        }
        ctx.putImageData(img, 0, 0);
      }
      this.thumbsDrawn = true;
    },
    async draw(what) {
      if (!this.thumbsDrawn) await this.drawThumbs();
      const m = scaleMax();
      if (what !== "query") {
        this.map.draw(W, (v) => seqRGB(v / m), (i, j, v) => labels[i] + " \u2192 " + labels[j] + ": " + v.toFixed(4));
        $("matrix-title").textContent = headName();
        $("legend-max").textContent = m.toFixed(state.stretch ? 3 : 0);
        this.thumbEls.forEach((row, li) => row.forEach((t, hi) =>
          t.button.classList.toggle("selected", li === state.row && hi === state.hi)));
      }
      this.map.path(state.query, state.dir);
      highlightAttention();
    },
  };
  function headMax(w) { let m = 0; for (let i = 0; i < w.length; i++) if (w[i] > m) m = w[i]; return m || 1; }
  const scaleMax = () => (state.stretch ? headMax(W) : 1);
  function highlightAttention() {
    const q = state.query;
    if (q === null) { paintStrip(null); return; }
    const m = scaleMax(), values = rowOf(W, q, state.dir);
    paintStrip(values, m);
    let best = 0;
    for (let j = 1; j < T; j++) if (values[j] > values[best]) best = j;
    const other = JSON.stringify(info.tokens[best]) + " (" + values[best].toFixed(3) + ").";
    $("readout").textContent = "Token " + q + " " + JSON.stringify(info.tokens[q])
      + (state.dir === "row" ? " attends most to token " : " is attended most by token ") + best + " " + other;
  }

  // (2) The tutorials' steps for the selected head.
  views.steps = {
    build() {},
    async draw(what) {
      highlightAttention();
      const key = state.row + "." + state.hi;
      if (what === "query" && this.drawn === key) return;
      this.drawn = key;
      const s = await source.steps(state.row, headNumber());
      if (this.drawn !== key || gone()) return;  // another head (or prompt) was chosen meanwhile
      const box = $("steps");
      box.textContent = "";
      $("steps-title").textContent = "The tutorials' steps, " + headName();
      if (!s) {
        $("steps-note").textContent = "This page does not hold the steps of " + headName()
          + " (they would make it too big)." + (info.stepsHint ? " " + info.stepsHint + "." : "")
          + " It holds them for:";
        const list = el("div", "player");
        for (const { row, head } of info.stepHeads) {
          const hi = layers[row].heads.indexOf(head);
          const b = el("button", "", layers[row].name + " \u00b7 head " + head);
          b.type = "button";
          b.dataset.row = String(row); b.dataset.head = String(head);
          b.addEventListener("click", () => select(row, hi));
          list.appendChild(b);
        }
        box.appendChild(list);
        return;
      }
      const { T: R, S, hd, scale } = s;
      const usual = Math.abs(scale - 1 / Math.sqrt(hd)) < 1e-6;
      $("steps-note").textContent = "Queries, keys and values of this head, then the steps of \u201cA simple "
        + "self-attention mechanism\u201d as the model computed them. Scale = "
        + (usual ? "1/\u221a" + hd + " = " : "") + scale.toFixed(4) + ". Hover a cell for its number.";
      const f32 = Math.fround, sc = f32(scale), cap = s.softcap;
      const scaled = new Float32Array(R * S), masked = new Float32Array(R * S);
      const capped = cap ? new Float32Array(R * S) : scaled;  // a soft-capped head (Gemma 2): cap * tanh(x / cap)
      for (let p = 0; p < R * S; p++) {
        scaled[p] = f32(s.scores[p] * sc);  // float32 arithmetic, as torch
        if (cap) capped[p] = f32(cap * Math.tanh(scaled[p] / cap));
        masked[p] = s.allowed[p] > 0.5 ? (s.bias ? f32(capped[p] + s.bias[p]) : capped[p]) : -Infinity;
      }
      let all = true;
      for (let p = 0; p < R * S && all; p++) all = s.allowed[p] > 0.5;
      const maskedName = s.names.masked + (all && !s.bias && s.names.masked.includes("masked_fill")
        ? "   (nothing is masked here)" : "");
      const absMax = (a) => { let m = 0; for (const v of a) if (isFinite(v) && Math.abs(v) > m) m = Math.abs(v);
                              return m || 1; };
      const tl = (i) => labels[i] || String(i), dim = (e) => "d" + e;
      const panels = [
        ["q", s.names.q, s.q, R, hd, tl, dim, "div"],
        ["k", s.names.k, s.k, S, hd, tl, dim, "div"],
        ["v", s.names.v, s.v, S, hd, tl, dim, "div"],
        ["scores", s.names.scores, s.scores, R, S, tl, tl, "div"],
        ["scaled", s.names.scaled, scaled, R, S, tl, tl, "div"],
        ...(cap ? [["capped", s.names.capped + "   (cap = " + cap + ")", capped, R, S, tl, tl, "div"]] : []),
        ["masked", maskedName, masked, R, S, tl, tl, "div"],
        ["weights", s.names.weights, s.weights, R, S, tl, tl, "seq"],
        ["head_outputs", s.names.head_outputs, s.head_outputs, R, hd, tl, dim, "div"],
      ];
      const readout = $("steps-readout");
      const explain = {
        q: (i, j, v) => "queries[" + i + ", " + j + "] = " + fmt(v, 4),
        k: (i, j, v) => "keys[" + i + ", " + j + "] = " + fmt(v, 4),
        v: (i, j, v) => "values[" + i + ", " + j + "] = " + fmt(v, 4),
        scores: (i, j, v) => "attn_scores[" + i + ", " + j + "] = queries[" + i + "] \u00b7 keys[" + j + "] = "
          + fmt(v, 4),
        scaled: (i, j, v) => "attn_scores[" + i + ", " + j + "] / \u221a" + hd + " = " + fmt(s.scores[i * S + j], 4)
          + " \u00d7 " + scale.toFixed(4) + " = " + fmt(v, 4),
        capped: (i, j, v) => cap + " \u00d7 tanh(" + fmt(scaled[i * S + j], 4) + " / " + cap + ") = " + fmt(v, 4),
        masked: (i, j, v) => v === -Infinity ? "masked[" + i + ", " + j + "] = -inf: query " + i
          + " may not attend to key " + j : "masked[" + i + ", " + j + "] = " + fmt(v, 4) + " (kept)",
        weights: (i, j, v) => "attn_weights[" + i + ", " + j + "] = softmax(masked[" + i + "])[" + j + "] = "
          + fmt(v, 4),
        head_outputs: (i, j, v) => "context_vec[" + i + ", " + j + "] = \u03a3 attn_weights[" + i
          + ", :] \u00b7 values[:, " + j + "] = " + fmt(v, 4),
      };
      for (const [key, title, values, rows, cols, rl, cl, kind] of panels) {
        const panel = el("section", "step");
        panel.dataset.step = key;
        const h = el("h3", "", "");
        h.appendChild(el("code", "", title));
        panel.appendChild(h);
        const box2 = el("div", "matrix");
        panel.appendChild(box2);
        box.appendChild(panel);
        const width = cols > 32 ? 420 : 260;
        const map = new Heatmap(box2, {
          rows: rows, cols: cols, key: "value", rowLabel: rl, colLabel: cl, width: width, numbers: true,
          onHover: (i, j) => { readout.textContent = explain[key](i, j, values[i * cols + j]); },
        });
        const m = absMax(values);
        map.draw(values, kind === "seq" ? (v) => seqRGB(v) : (v) => divRGB(v === -Infinity ? v : v / m),
                 (i, j, v) => explain[key](i, j, v));
      }
    },
  };

  // (3) Next-token probabilities at the chosen position, under temperature / top-k / top-p.
  views.next = {
    build() {
      const temp = $("temperature"), k = $("top-k"), p = $("top-p"), grid = info.temperatures;
      if (grid) {  // the slider steps through the temperatures the page holds
        temp.min = "0"; temp.max = String(grid.length - 1); temp.step = "1";
        temp.value = String(Math.max(0, grid.indexOf(1)));
      }
      const update = () => {
        state.temperature = grid ? grid[Number(temp.value)] : Number(temp.value);
        state.topK = topK(k);
        state.topP = Number(p.value);
        $("temperature-value").textContent = state.temperature.toFixed(grid ? 1 : 2);
        $("top-p-value").textContent = state.topP.toFixed(2);
        if (this.ready && state.view === "next") redraw("view");
      };
      for (const input of [temp, k, p]) on(input, "input", update);
      update();
      this.ready = true;
    },
    async draw() {
      const pos = state.query === null ? T - 1 : state.query;
      paintStrip(null);
      $("next-title").textContent = "Next token after position " + pos + " (" + labels[pos] + ")";
      const stale = claim(this);  // a live source answers in its own time
      const r = await source.nextTokens(pos, { temperature: state.temperature, topK: state.topK, topP: state.topP });
      const shown = Math.min(r.ids.length, 12), names = [];
      for (let i = 0; i < shown; i++) names.push(await source.label(r.ids[i]));
      if (stale()) return;  // a newer draw (or inspector) is on its way
      const table = $("next-table");
      table.textContent = "";
      const head = el("tr");
      for (const h of ["#", "token", "", "probability"]) head.appendChild(el("th", "", h));
      table.appendChild(head);
      const actual = pos + 1 < T ? info.tokens[pos + 1] : null;
      for (let i = 0; i < shown; i++) {
        const tr = el("tr", r.probs[i] > 0 ? "" : "out");
        tr.dataset.id = String(r.ids[i]); tr.dataset.prob = String(r.probs[i]);
        tr.appendChild(el("td", "num", String(i + 1)));
        const label = names[i];
        tr.appendChild(el("td", "", label + (actual !== null && label === labels[pos + 1] ? "   \u2190 next in the text" : "")));
        const bar = el("td", "barcell"), fill = el("div", "bar");
        fill.style.width = (100 * r.probs[i]).toFixed(1) + "%";
        bar.appendChild(fill); tr.appendChild(bar);
        tr.appendChild(el("td", "num", prob(r.probs[i])));
        table.appendChild(tr);
      }
      const kept = r.probs.filter((x) => x > 0).length;
      $("next-note").textContent = (r.greedy ? "Temperature 0 is greedy: the likeliest token is always chosen. "
        : "Probabilities as generation samples them (attnlab.generation.SamplingConfig): temperature, then top-k, "
          + "then the top-p nucleus, renormalised. ")
        + (r.approx ? "Approximate: the tokens that can be drawn reach past the " + r.ids.length
            + " stored here, so the shown ones are divided by top-p instead of their exact total. "
          : (state.topK || state.topP < 1) && !r.greedy ? kept + " token" + (kept === 1 ? "" : "s") + " can be drawn. " : "")
        + "Hover or click a token above to pick the position.";
    },
  };

  // (4) Attention rollout.
  views.rollout = {
    async build() {
      const sel = $("rollout-fusion");
      sel.textContent = "";
      for (const f of ["mean", "max", "min"]) sel.appendChild(new Option(f, f));
      sel.value = state.fusion;
      on(sel, "change", () => { state.fusion = sel.value; this.matrix = null; redraw("view"); });
      this.map = new Heatmap($("rollout"), {
        rows: T, cols: T, key: "value", rowLabel: (i) => labels[i], colLabel: (j) => labels[j],
        onHover: (i, j) => {
          setQuery(i);
          $("rollout-readout").textContent = "rollout[" + i + ", " + j + "] = " + this.matrix[i * T + j].toFixed(4)
            + ": the share of " + labels[j] + " in " + labels[i] + " at the top";
        },
      });
    },
    async draw(what) {
      if (!this.matrix) {
        const matrix = await source.rollout(state.fusion);
        if (this.matrix || gone()) return;  // drawn meanwhile, or a newer inspector has the page
        this.matrix = matrix;
        let m = 0;
        for (const v of this.matrix) if (v > m) m = v;
        this.max = m || 1;
        this.map.draw(this.matrix, (v) => seqRGB(v / this.max), (i, j, v) => labels[i] + " \u2190 " + labels[j] + ": "
          + v.toFixed(4));
      }
      this.map.path(state.query, "row");
      if (state.query === null) { paintStrip(null); return; }
      const row = rowOf(this.matrix, state.query, "row");
      let m = 0;
      for (const v of row) if (v > m) m = v;
      paintStrip(row, m || 1, 3);
      $("readout").textContent = "Rollout row of token " + state.query + " " + JSON.stringify(info.tokens[state.query])
        + ": how much each token flows into it at the top.";
    },
  };

  // (5) The logit lens.
  views.lens = {
    build() {},
    async draw() {
      const stale = claim(this);  // (as the next-token view's: one draw writes)
      const pos = state.query === null ? T - 1 : state.query;
      const lo = Math.max(0, Math.min(pos - 6, T - 13)), hi = Math.min(T, lo + 13);
      const d = await source.lens(lo, hi), k = d.k, rows = d.rows.length, W = d.width, at = (l, t) => l * W + t - d.start;
      const out = [];  // the table's rows, written at the end
      const head = el("tr");
      head.appendChild(el("th", "", "residual stream"));
      for (let t = lo; t < hi; t++) {
        const th = el("th", t === pos ? "active" : "", t + " " + labels[t]);
        th.dataset.pos = String(t);
        head.appendChild(th);
      }
      head.appendChild(el("th", "", "p(final choice) at " + pos));
      out.push(head);
      for (let l = 0; l < rows; l++) {
        const tr = el("tr");
        tr.appendChild(el("th", "", d.rows[l] + (l === rows - 1 ? " (= output)" : "")));
        for (let t = lo; t < hi; t++) {
          const base = at(l, t) * k, p = d.probs[base], id = d.ids[base];
          const td = el("td", "cell", await source.label(id));
          const col = seqRGB(p);
          td.style.backgroundColor = css(col);
          if (dark(col)) td.style.color = "white";
          td.dataset.layer = String(l); td.dataset.pos = String(t); td.dataset.id = String(id); td.dataset.prob = String(p);
          const top = [];
          for (let c = 0; c < k; c++) top.push((await source.label(d.ids[base + c])) + " " + d.probs[base + c].toFixed(3));
          td.title = d.rows[l] + ", position " + t + ": " + top.join(", ");
          td.addEventListener("mouseenter", () => { $("lens-readout").textContent = td.title; });
          tr.appendChild(td);
        }
        tr.appendChild(el("td", "num", d.final[at(l, pos)].toFixed(4)));
        out.push(tr);
      }
      if (stale()) return;  // a newer draw (or inspector) owns the table
      paintStrip(null);
      $("lens-title").textContent = "Logit lens around position " + pos + " (" + labels[pos] + ")";
      $("lens-table").replaceChildren(...out);
    },
  };

  // (6) Head roles: a layers x heads grid per role; clicking a head selects it.
  views.roles = {
    async build() {
      this.data = await source.roles();
      const sel = $("role-kind");
      sel.textContent = "";
      for (const kind of this.data.kinds) sel.appendChild(new Option(kind, kind));
      if (!this.data.kinds.includes(state.role)) state.role = this.data.kinds[0];
      sel.value = state.role;
      on(sel, "change", () => { state.role = sel.value; redraw("view"); });
      $("roles-note").textContent = "Score: " + this.data.note + ". Click a head to look at it.";
    },
    draw() {
      const { L, H, scores } = this.data, s = scores[state.role], grid = $("roles-grid");
      grid.textContent = "";
      grid.style.gridTemplateColumns = "auto repeat(" + H + ", auto)";
      grid.appendChild(el("div", "rlabel", ""));
      for (let h = 0; h < H; h++) grid.appendChild(el("div", "rlabel", "head " + h));
      const realLayer = layers[state.row].layer;
      for (let l = 0; l < L; l++) {
        grid.appendChild(el("div", "rlabel", "layer " + l));
        for (let h = 0; h < H; h++) {
          const v = s[l * H + h], col = seqRGB(v);
          const c = el("div", "rcell", v.toFixed(2));
          c.style.backgroundColor = css(col);
          if (dark(col)) c.style.color = "white";
          c.dataset.layer = String(l); c.dataset.head = String(h); c.dataset.score = String(v);
          c.classList.toggle("selected", l === realLayer && h === headNumber());
          c.classList.toggle("ablated", ablated.has(l + "." + h));
          c.title = state.role + ": layer " + l + " head " + h + " = " + v.toFixed(4);
          c.addEventListener("mouseenter", () => { $("roles-readout").textContent = c.title; });
          c.addEventListener("click", () => headClick(l, h, () => {
            const row = layers.findIndex((x) => x.layer === l), hi = row < 0 ? -1 : layers[row].heads.indexOf(h);
            if (hi < 0) { $("roles-readout").textContent = "layer " + l + " head " + h + " is not on this page"; return; }
            select(row, hi);
            show("heads");
          }));
          grid.appendChild(c);
        }
      }
      paintStrip(null);
    },
  };

  // (7) Generation, played back token by token.
  views.generation = {
    async build() {
      this.data = await source.generation();  // a live source's grows as tokens stream in
      const n = () => this.data.steps.length;
      const stop = () => { clearInterval(this.timer); this.timer = null; $("gen-play").textContent = "play"; };
      if (opts.signal) opts.signal.addEventListener("abort", () => { if (this.timer) stop(); });
      on($("gen-prev"), "click", () => { state.gen = Math.max(0, state.gen - 1); redraw("view"); });
      on($("gen-next"), "click", () => { state.gen = Math.max(0, Math.min(n() - 1, state.gen + 1)); redraw("view"); });
      on($("gen-mean"), "change", (e) => { state.genMean = e.target.checked; redraw("view"); });
      $("gen-mean").checked = state.genMean;
      on($("gen-play"), "click", () => {
        if (this.timer) { stop(); return; }
        if (state.gen >= n() - 1) state.gen = 0;
        $("gen-play").textContent = "pause";
        this.timer = setInterval(() => {
          if (state.gen >= n() - 1) { stop(); return; }
          state.gen++; redraw("view");
        }, 700);
        redraw("view");
      });
    },
    async draw() {
      paintStrip(null);
      const g = this.data, st = g.settings || {};
      // (a live page has no settings until its first generation: no sampling to name yet)
      $("gen-title").textContent = "Generation, token by token" + (st.temperature === undefined ? ""
        : " (temperature " + st.temperature + (st.top_k ? ", top-k " + st.top_k : "")
          + (st.top_p ? ", top-p " + st.top_p : "") + ")");
      if (!g.steps.length) {  // a live page before "generate"
        claim(this);  // (a draw still waiting for labels must not write after this)
        $("gen-text").textContent = ""; $("gen-candidates").textContent = "";
        $("gen-step").textContent = g.live ? "Press \u201cgenerate\u201d above: each new token streams in with its "
          + "attention, drawn with the sampling settings of the Next token tab." : "";
        return;
      }
      state.gen = Math.max(0, Math.min(state.gen, g.steps.length - 1));
      const s = g.steps[state.gen], layer = layers[state.row].layer, head = headNumber();
      let w;
      if (state.genMean) {
        w = new Float32Array(s.S);
        for (let h = 0; h < s.H; h++) { const r = s.row(layer, h); for (let j = 0; j < s.S; j++) w[j] += r[j] / s.H; }
      } else w = s.row(layer, head);
      let m = 0;
      for (const v of w) if (v > m) m = v;
      const slot = new Map();  // token index -> the slot of its key (a cache may hold keys out of order)
      s.key_index.forEach((t, j) => { if (t >= 0) slot.set(t, j); });
      // Labels may come over the network (await): a draw builds everything first and writes the page only
      // if no later draw began meanwhile (a stream's steps come faster than their labels; two draws writing
      // at once interleaved their rows).
      const stale = claim(this);
      const spans = [];
      for (let t = 0; t <= s.position; t++) {
        const span = el("span", "tok" + (t >= g.prompt_length ? " generated" : "") + (t === s.position ? " current" : ""),
                        await source.label(g.tokens[t]));
        span.dataset.index = String(t);
        const j = slot.has(t) ? slot.get(t) : -1, wl = el("span", "w", "");
        if (j >= 0 && t < s.position) {
          const col = seqRGB(w[j] / (m || 1));
          span.style.backgroundColor = css(col);
          if (dark(col)) span.style.color = "white";
          span.dataset.weight = w[j].toFixed(4);
          wl.textContent = w[j].toFixed(2);
        }
        span.appendChild(wl);
        spans.push(span);
      }
      const stepText = "token " + (state.gen + 1) + " of " + g.steps.length + (g.streaming ? " so far" : "") + ": "
        + (await source.label(s.token)) + " (p = " + s.token_prob.toFixed(4) + "), attention of "
        + (state.genMean ? layers[state.row].name + ", mean over heads" : headName());
      const rows = [el("tr")];
      for (const h of ["#", "candidate", "probability"]) rows[0].appendChild(el("th", "", h));
      for (let i = 0; i < s.candidates.length; i++) {
        const tr = el("tr", s.candidates[i] === s.token ? "chosen" : "");
        tr.dataset.id = String(s.candidates[i]); tr.dataset.prob = String(s.probs[i]);
        tr.appendChild(el("td", "num", String(i + 1)));
        tr.appendChild(el("td", "", (await source.label(s.candidates[i])) + (s.candidates[i] === s.token ? "   \u2190 drawn" : "")));
        tr.appendChild(el("td", "num", s.probs[i].toFixed(4)));
        rows.push(tr);
      }
      if (stale()) return;  // a newer draw (or inspector) owns the page
      $("gen-text").replaceChildren(...spans);
      $("gen-step").textContent = stepText;
      $("gen-candidates").replaceChildren(...rows);
    },
  };

  // Views in files of their own (patching.js, loaded before this file, registers in ATTNLAB_VIEWS;
  // features.js, loaded alone on an offline page, declares FeaturesView): each says whether this page
  // has its data.
  const more = Object.assign({}, typeof ATTNLAB_VIEWS !== "undefined" ? ATTNLAB_VIEWS : {});
  if (typeof FeaturesView !== "undefined") more.features = (ctx) => new FeaturesView(ctx);
  for (const [name, make] of Object.entries(more)) {
    views[name] = make({ source: source, info: info, on: on, signal: opts.signal, paintStrip: paintStrip,
                         state: state, redraw: (what) => redraw(what) });
    info.has[name] = views[name].available;
  }

  // ---- tabs, selection, redraws ------------------------------------------------------------------
  const tabs = Array.from(document.querySelectorAll("#tabs .tab"));
  for (const tab of tabs) {
    const name = tab.dataset.view, ok = name === "heads" || info.has[name];
    tab.disabled = !ok;
    if (!ok) tab.title = "not available for this page" + (name === "features" ? " (no SAE: attnlab viz or serve --sae DIR)"
      : name !== "steps" ? " (the model is not a language model, or this part was not computed)" : "");
    on(tab, "click", () => show(name));
  }
  async function show(name) {
    if (!views[name] || !(name === "heads" || info.has[name])) return;
    state.view = name;
    for (const tab of tabs) tab.classList.toggle("active", tab.dataset.view === name);
    document.querySelectorAll("main > .view").forEach((v) => { v.hidden = v.dataset.view !== name; });
    await redraw("view");
  }
  async function redraw(what) {
    const name = state.view, view = views[name];
    try {
      if (!built[name]) built[name] = Promise.resolve(view.build()).catch((err) => { delete built[name]; throw err; });
      await built[name];
      if (opts.signal && opts.signal.aborted) return;  // a newer inspector has the page
      const t0 = performance.now();
      await view.draw(what);
      document.body.dataset.paintMs = (performance.now() - t0).toFixed(1);
    } catch (err) {
      if (err && err.name === "AbortError") return;  // a live request overtaken by a newer one
      $("status").textContent = "Could not draw the " + name + " view: " + (err && err.message);
      throw err;
    }
  }
  async function select(row, hi) {
    const t0 = performance.now();
    const rowChanged = row !== state.row;
    state.row = row;
    state.hi = Math.min(hi, layers[row].heads.length - 1);
    layerSel.value = String(state.row);
    if (rowChanged || headSel.options.length === 0) fillHeads();
    headSel.value = String(state.hi);
    W = await source.weights(state.row, state.hi);
    await redraw("head");
    // The time until the browser has painted the new view: the frame after the next one.
    requestAnimationFrame(() => setTimeout(() => {
      document.body.dataset.frameMs = (performance.now() - t0).toFixed(1);
    }, 0));
  }

  on(layerSel, "change", () => select(Number(layerSel.value), state.hi));
  on(headSel, "change", () => select(state.row, Number(headSel.value)));
  document.querySelectorAll('input[name="direction"]').forEach((r) => {
    r.checked = r.value === state.dir;
    on(r, "change", () => { state.dir = r.value; redraw("query"); });
  });
  $("stretch").checked = state.stretch;
  on($("stretch"), "change", (e) => { state.stretch = e.target.checked; redraw("head"); });

  // Marks on the heads that are ablated (a live page): thumbnails and the roles grid.
  function markAblated() {
    document.querySelectorAll("#thumbs .thumb").forEach((b) => {
      const layer = layers[Number(b.dataset.layer)];
      b.classList.toggle("ablated", ablated.has(layer.layer + "." + layer.heads[Number(b.dataset.head)]));
    });
    document.querySelectorAll("#roles-grid .rcell").forEach((c) =>
      c.classList.toggle("ablated", ablated.has(c.dataset.layer + "." + c.dataset.head)));
  }

  const wanted = views[state.view] && (state.view === "heads" || info.has[state.view]) ? state.view : "heads";
  state.view = "heads";
  for (const tab of tabs) tab.classList.toggle("active", tab.dataset.view === "heads");
  document.querySelectorAll("main > .view").forEach((v) => { v.hidden = v.dataset.view !== "heads"; });
  await select(state.row, state.hi);
  if (wanted !== "heads") await show(wanted);
  document.body.dataset.readyMs = performance.now().toFixed(0);
  document.body.dataset.ready = "1";
  const inspector = { state: state, show: show, select: select, source: source, redraw: redraw, markAblated: markAblated,
                      info: info };
  window.attnlabInspector = inspector;
  return inspector;
}

function showAttention(data) {
  return new EmbeddedSource(data).open().then(showInspector);
}

// The offline page: its data is embedded in the page.
(function () {
  const embedded = document.getElementById("attn-data");
  if (!embedded) return;
  showAttention(JSON.parse(embedded.textContent)).catch((err) => {
    document.getElementById("status").textContent = "The page could not be shown: " + err.message;
    document.body.dataset.error = String(err.message);
    throw err;
  });
})();

// ------------------------------------------------------------------------------------------------
// The live page of `attnlab serve`: the same views, their data from the server's JSON API.
// ------------------------------------------------------------------------------------------------
class Api {
  constructor(base) { this.base = base; }
  async request(path, body, signal) {
    const init = body === undefined ? { signal: signal }
      : { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal: signal };
    const r = await fetch(this.base + path, init);
    if (!r.ok) {
      let detail = r.status + " " + r.statusText;
      try { detail = (await r.json()).detail || detail; } catch (e) { /* not JSON */ }
      const err = new Error(detail);
      err.status = r.status;
      throw err;
    }
    return r;
  }
  async get(path, signal) { return (await this.request(path, undefined, signal)).json(); }
  async post(path, body, signal) { return (await this.request(path, body, signal)).json(); }
}

// A prompt's data: the heads come with it (POST api/inspect, sections ["layers"]); the other sections
// are asked for when a view first needs them, next-token probabilities for each setting of the
// controls (any temperature, over the whole vocabulary). shared holds what outlives a prompt (roles).
class LiveSource extends EmbeddedSource {
  constructor(api, prompt, data, shared) {
    super(data);
    this.api = api; this.prompt = prompt; this.shared = shared;
    this.pending = new Map();
    data.vocab = data.vocab || {};
    data.steps = { names: {}, heads: [], omitted: 0, hint: "" };
    this.gen = { live: true, streaming: false, prompt_length: data.tokens.length, tokens: data.ids.slice(),
                 settings: {}, steps: [] };
  }
  learn(labels) { Object.assign(this.data.vocab, labels || {}); }
  section(name, extra) {  // one section of inspector_data for this prompt, fetched once
    const key = name + JSON.stringify(extra || {});
    if (!this.pending.has(key)) {
      const p = this.api.post("inspect", Object.assign({ prompt: this.prompt, sections: [name] }, extra || {}))
        .then((d) => { this.learn(d.vocab); return d; });
      p.catch(() => this.pending.delete(key));
      this.pending.set(key, p);
    }
    return this.pending.get(key);
  }
  info() {
    const i = super.info();
    i.has = { steps: true, next: true, rollout: true, lens: true, roles: true, generation: true };
    i.temperatures = null;  // any temperature: the server computes each distribution
    i.title = (this.data.model && this.data.model.name ? this.data.model.name : "a model") + ", live";
    i.live = true;
    return i;
  }
  async steps(row, head) {
    const layer = this.data.layers[row].layer;
    const d = await this.section("steps", { steps: [layer + "." + head] });
    this.data.steps.names = d.steps.names;
    for (const h of d.steps.heads)
      if (!this.data.steps.heads.some((x) => x.row === row && x.head === h.head))
        this.data.steps.heads.push(Object.assign({}, h, { row: row }));
    return super.steps(row, head);
  }
  async nextTokens(pos, settings) {
    const r = await this.api.post("next", {
      prompt: this.prompt, position: pos, temperature: settings.temperature,
      top_k: settings.topK > 0 ? settings.topK : null, top_p: settings.topP < 1 ? settings.topP : null, k: 32,
    });
    this.learn(r.labels);
    return { ids: r.ids, probs: r.probs, approx: false, greedy: r.greedy };
  }
  async rollout(fusion) {
    this.data.rollout = (await this.section("rollout")).rollout;
    return super.rollout(fusion);
  }
  async lens(lo, hi) {  // the positions the view shows, asked for by window: the lens costs per position
    this.data.lens = (await this.section("lens", { lens_window: [lo, hi] })).lens;
    return super.lens(lo, hi);
  }
  async roles() {  // the model's, not the prompt's: asked for once
    if (!this.shared.roles) {
      this.shared.roles = this.api.post("inspect", { prompt: this.prompt, sections: ["roles"] });
      this.shared.roles.catch(() => { this.shared.roles = null; });
    }
    this.data.roles = (await this.shared.roles).roles;
    return super.roles();
  }
  generation() { return this.gen; }
}

const DEBOUNCE_MS = 250;

// Server-sent events of a fetch response: onEvent(name, data) per event, until the stream ends.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buf = "";
  const frame = (text) => {
    let event = "message", data = "";
    for (const line of text.split("\n")) {
      if (line.startsWith("event:")) event = line.slice(6).trim();
      else if (line.startsWith("data:")) data += line.slice(5).trim();
    }
    if (data) onEvent(event, JSON.parse(data));
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) { frame(buf.slice(0, cut)); buf = buf.slice(cut + 2); }
  }
}

class LiveApp {
  constructor(config) {
    this.api = new Api(config.api || "api/");
    this.shared = {};
    this.ablated = new Set();  // "layer.head"
    this.seq = 0; this.ablationSeq = 0;
    this.inspector = null; this.controller = null; this.fetching = null; this.generating = null;
  }
  status(text, error) {
    const s = document.getElementById("live-status");
    s.textContent = text;
    s.classList.toggle("error", !!error);
  }
  async start() {
    const $ = (id) => document.getElementById(id);
    this.info = await this.api.get("info");
    this.shared.info = this.info;  // (what the views of every prompt may need: the Features tab's SAEs)
    $("live").hidden = false;
    const box = $("prompt");
    if (!this.info.language_model) {  // the tutorials' six-word example: fixed embeddings, nothing to type
      const data = await this.api.get("demo");
      box.value = data.text;
      box.disabled = true; $("generate").disabled = true; $("max-new").disabled = true; $("seed").disabled = true;
      this.status("The six words of \u201cA simple self-attention mechanism\u201d have fixed 3-d embeddings: typing, "
        + "generating and ablating need a language model (attnlab serve --checkpoint DIR or --model NAME).");
      await showAttention(data);
      return;
    }
    $("click-mode").hidden = false;
    box.maxLength = this.info.limits.max_prompt_chars;
    $("max-new").max = String(this.info.limits.max_new_tokens);
    box.value = this.info.default_prompt;
    box.addEventListener("input", () => {
      clearTimeout(this.timer);
      this.timer = setTimeout(() => this.analyze(), DEBOUNCE_MS);
    });
    $("generate").addEventListener("click", () => this.generate());
    $("stop").addEventListener("click", () => this.stopGeneration());
    $("ablation-clear").addEventListener("click", () => { this.ablated.clear(); this.updateAblation(); });
    if (this.info.chat) this.startChat();
    await this.analyze();
  }

  // The chat box (a model with a chat template): the page keeps the conversation and sends it whole
  // with each message (POST api/chat); the answer streams in; "open in the inspector" makes the
  // conversation the model read, and its answer, the prompt of the views.
  startChat() {
    const $ = (id) => document.getElementById(id);
    this.chatMessages = []; this.chatting = null;
    $("chat").hidden = false;
    $("chat-max-new").max = String(this.info.limits.max_new_tokens);
    $("chat-send").addEventListener("click", () => this.sendChat());
    $("chat-stop").addEventListener("click", () => this.stopChat());
    $("chat-reset").addEventListener("click", () => {
      this.stopChat();
      this.chatMessages = []; $("chat-log").textContent = ""; this.chatStatus("A new conversation.");
    });
    $("chat-input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); this.sendChat(); }
    });
  }
  chatStatus(text, error) {
    const s = document.getElementById("chat-status");
    s.textContent = text;
    s.classList.toggle("error", !!error);
  }
  chatBubble(role, text) {
    const div = el("div", "chat-msg " + role);
    div.appendChild(el("span", "who", role === "user" ? "you" : "assistant"));
    const body = el("span", "text", text);
    div.appendChild(body);
    document.getElementById("chat-log").appendChild(div);
    return { div: div, body: body };
  }
  async sendChat() {
    const $ = (id) => document.getElementById(id);
    const text = $("chat-input").value;
    if (!text.trim() || this.chatting) return;
    $("chat-input").value = "";
    const user = { role: "user", content: text }, system = $("chat-system").value;
    const messages = (system ? [{ role: "system", content: system }] : []).concat(this.chatMessages, [user]);
    const limit = this.info.limits.max_new_tokens;
    const n = Math.max(1, Math.min(limit, Math.floor(Number($("chat-max-new").value) || 1)));
    const seed = Math.max(0, Math.floor(Number($("seed").value) || 0));
    const body = Object.assign({ messages: messages, max_new_tokens: n, seed: seed }, this.sampling());
    this.chatBubble("user", text);
    const answer = this.chatBubble("assistant", "");
    const ctl = (this.chatting = new AbortController());
    $("chat-send").disabled = true; $("chat-stop").disabled = false;
    document.body.dataset.chatting = "1";
    this.chatStatus("Answering\u2026");
    let done = null;
    try {
      const r = await this.api.request("chat", body, ctl.signal);
      await readEvents(r, (event, d) => {
        if (event === "start" && d.dropped > 0) {
          this.chatMessages = this.chatMessages.slice(d.dropped);
          this.chatStatus("The oldest " + d.dropped + " messages were dropped to fit the context window.");
        } else if (event === "token") {
          answer.body.textContent += d.text;
        } else if (event === "error") {
          this.chatStatus(d.detail, true);
        } else if (event === "done") {
          done = d;
        }
      });
    } catch (err) {
      if (err.name !== "AbortError") { this.chatStatus(err.message, true); answer.div.remove(); }
    } finally {
      if (this.chatting === ctl) this.chatting = null;
      $("chat-send").disabled = false; $("chat-stop").disabled = true;
      delete document.body.dataset.chatting;
    }
    if (!done) {  // stopped: what was said stays in the conversation; failed: the message is not sent
      if (ctl.signal.aborted) this.chatMessages.push(user, { role: "assistant", content: answer.body.textContent });
      return;
    }
    answer.body.textContent = done.answer;
    this.chatMessages.push(user, { role: "assistant", content: done.answer });
    const open = el("button", "", "open in the inspector");
    open.type = "button";
    open.addEventListener("click", () => {
      $("prompt").value = done.inspect;
      window.scrollTo(0, 0);
      this.analyze();
    });
    answer.div.appendChild(el("br"));
    answer.div.appendChild(open);
    this.chatStatus(done.generated + " token" + (done.generated === 1 ? "" : "s")
      + (done.reason === "stop" ? ", ended by the model's end-of-turn token."
        : done.reason === "length" ? ": cut at the token limit." : " (" + done.reason + ")."));
    document.body.dataset.chatAnswers = String(this.chatMessages.length / 2);
  }
  stopChat() {
    if (!this.chatting) return;
    this.chatting.abort();  // closes the connection: the server stops the answer
    this.chatting = null;
    this.chatStatus("Answer stopped.");
  }

  // The prompt's tokens and every head's attention; the views redraw with the reader's choices kept.
  async analyze() {
    const prompt = document.getElementById("prompt").value, seq = ++this.seq, t0 = performance.now();
    if (this.fetching) this.fetching.abort();
    this.stopGeneration();
    if (!prompt) { this.status("Type a prompt."); return; }
    const ctl = (this.fetching = new AbortController());
    this.status("Reading the prompt\u2026");
    let data;
    try {
      data = await this.api.post("inspect", { prompt: prompt, sections: ["layers"] }, ctl.signal);
    } catch (err) {
      if (err.name === "AbortError" || seq !== this.seq) return;
      this.status(err.message, true);
      document.body.dataset.liveError = err.message;
      return;
    }
    if (seq !== this.seq) return;
    const t1 = performance.now();
    const keep = {};
    if (this.inspector) {
      for (const k of ["row", "hi", "view", "dir", "stretch", "temperature", "topK", "topP", "fusion", "role", "genMean"])
        keep[k] = this.inspector.state[k];
    }
    if (this.controller) this.controller.abort();
    this.controller = new AbortController();
    this.source = new LiveSource(this.api, prompt, data, this.shared);
    this.inspector = await showInspector(this.source, {
      signal: this.controller.signal, state: keep, ablated: this.ablated,
      onHeadClick: (layer, head) => this.toggleAblation(layer, head),
    });
    if (seq !== this.seq) return;
    const t2 = performance.now();
    delete document.body.dataset.liveError;
    this.status(data.tokens.length + " tokens \u00b7 answered in " + (t1 - t0).toFixed(0) + " ms, drawn in "
      + (t2 - t1).toFixed(0) + " ms");
    document.body.dataset.livePrompt = prompt;
    document.body.dataset.liveMs = (t2 - t0).toFixed(1);
    document.body.dataset.liveSeq = String(seq);
    if (this.ablated.size) this.updateAblation();
  }

  sampling() {
    const $ = (id) => document.getElementById(id);
    const t = Number($("temperature").value), k = topK($("top-k")), p = Number($("top-p").value);
    return { temperature: t, top_k: k > 0 ? k : null, top_p: p < 1 ? p : null };
  }

  // Generation as server-sent events: each token arrives with its attention and joins the playback.
  async generate() {
    const $ = (id) => document.getElementById(id);
    if (!this.source) return;
    this.stopGeneration();
    const source = this.source, gen = source.gen, ctl = (this.generating = new AbortController());
    const limit = this.info.limits.max_new_tokens;
    const n = Math.max(1, Math.min(limit, Math.floor(Number($("max-new").value) || 1)));
    const seed = Math.max(0, Math.floor(Number($("seed").value) || 0));
    const body = Object.assign({ prompt: source.prompt, max_new_tokens: n, seed: seed }, this.sampling());
    gen.steps = []; gen.tokens = source.data.ids.slice(); gen.streaming = true;
    gen.settings = { temperature: body.temperature, top_k: body.top_k, top_p: body.top_p };
    $("generate").disabled = true; $("stop").disabled = false;
    document.body.dataset.generating = "1";
    this.status("Generating\u2026");
    await this.inspector.show("generation");
    try {
      const r = await this.api.request("generate", body, ctl.signal);
      const reader = r.body.getReader(), decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          this.onEvent(buf.slice(0, cut), source, ctl);
          buf = buf.slice(cut + 2);
        }
      }
    } catch (err) {
      if (err.name !== "AbortError") this.status(err.message, true);
    } finally {
      gen.streaming = false;
      if (this.generating === ctl) {
        this.generating = null;
        $("generate").disabled = false; $("stop").disabled = true;
        delete document.body.dataset.generating;
        if (this.source === source) this.inspector.redraw("view");
      }
    }
  }
  onEvent(frame, source, ctl) {
    let event = "message", data = "";
    for (const line of frame.split("\n")) {
      if (line.startsWith("event:")) event = line.slice(6).trim();
      else if (line.startsWith("data:")) data += line.slice(5).trim();
    }
    if (!data || ctl.signal.aborted) return;
    const d = JSON.parse(data), gen = source.gen;
    if (event === "start") {
      source.learn(d.labels);
      gen.prompt_length = d.prompt_length; gen.tokens = d.tokens.slice();
    } else if (event === "token") {
      source.learn(d.labels);
      gen.tokens.push(d.token);
      gen.steps.push(playbackStep(d, new PackedArray(d.weights, null)));
      this.status("Generated " + gen.steps.length + " token" + (gen.steps.length === 1 ? "" : "s") + "\u2026");
      if (this.source === source) {
        this.inspector.state.gen = gen.steps.length - 1;
        if (this.inspector.state.view === "generation") this.inspector.redraw("view");
      }
      document.body.dataset.generated = String(gen.steps.length);
    } else if (event === "error") {
      this.status(d.detail, true);
    } else if (event === "done") {
      this.status("Generated " + d.generated + " token" + (d.generated === 1 ? "" : "s")
        + (d.reason === "length" ? "." : " (" + d.reason + ")."));
      document.body.dataset.generationDone = String(d.generated);
    }
  }
  stopGeneration() {
    if (!this.generating) return;
    this.generating.abort();  // closes the connection: the server stops generating
    this.generating = null;
    document.getElementById("generate").disabled = false;
    document.getElementById("stop").disabled = true;
    delete document.body.dataset.generating;
    this.status("Generation stopped.");
  }

  // Ablation: heads clicked in "ablates it" mode are removed; the panel shows what the next token
  // after the prompt becomes without them (attnlab.interpret.ablation_effect, on the server).
  toggleAblation(layer, head) {
    const key = layer + "." + head;
    if (this.ablated.has(key)) this.ablated.delete(key); else this.ablated.add(key);
    this.updateAblation();
  }
  async updateAblation() {
    const $ = (id) => document.getElementById(id);
    if (this.inspector) this.inspector.markAblated();
    const seq = ++this.ablationSeq;
    if (!this.ablated.size) { $("ablation").hidden = true; return; }
    $("ablation").hidden = false;
    const heads = Array.from(this.ablated).sort((a, b) => {
      const [la, ha] = a.split(".").map(Number), [lb, hb] = b.split(".").map(Number);
      return la - lb || ha - hb;
    });
    $("ablation-title").textContent = "Without head" + (heads.length === 1 ? " " : "s ") + heads.join(", ");
    const source = this.source;
    let r;
    try {
      r = await this.api.post("ablate", Object.assign({ prompt: source.prompt, heads: heads, k: 8 }, this.sampling()));
    } catch (err) {
      if (seq === this.ablationSeq) { $("ablation-note").textContent = err.message; $("ablation-note").classList.add("error"); }
      return;
    }
    if (seq !== this.ablationSeq) return;
    source.learn(r.labels);
    const note = $("ablation-note");
    note.classList.remove("error");
    note.textContent = "Their outputs set to zero before the output projection. Next token after the last one, "
      + "with the sampling settings of the Next token tab; KL(before \u2016 after) = " + r.kl.toFixed(4)
      + (r.loss_before === null ? "." : "; loss over the prompt " + r.loss_before.toFixed(4) + " \u2192 "
        + r.loss_after.toFixed(4) + " nats (" + (r.loss_change >= 0 ? "+" : "") + r.loss_change.toFixed(4) + ").");
    const table = $("ablation-table");
    table.textContent = "";
    const head = el("tr");
    for (const h of ["token", "before", "after", "change"]) head.appendChild(el("th", "", h));
    table.appendChild(head);
    for (const row of r.rows) {
      const tr = el("tr");
      tr.dataset.id = String(row.id); tr.dataset.before = String(row.before); tr.dataset.after = String(row.after);
      tr.appendChild(el("td", "", await source.label(row.id)));
      tr.appendChild(el("td", "num", prob(row.before)));
      tr.appendChild(el("td", "num", prob(row.after)));
      const d = row.after - row.before;
      tr.appendChild(el("td", "num " + (d > 0 ? "up" : d < 0 ? "down" : ""), (d >= 0 ? "+" : "") + d.toFixed(4)));
      table.appendChild(tr);
    }
    document.body.dataset.ablation = heads.join(",");
  }
}

// The live page: its configuration is embedded, its data comes from the server.
(function () {
  const live = document.getElementById("attn-live");
  if (!live) return;
  new LiveApp(JSON.parse(live.textContent)).start().catch((err) => {
    document.getElementById("status").textContent = "The page could not be shown: " + err.message;
    document.body.dataset.error = String(err.message);
    throw err;
  });
})();
