// The attention viewer of `attnlab viz`. Plain ES2017, no libraries. Everything is built with
// createElement + textContent: token text is never parsed as HTML.
//
// showAttention(data) builds the page from one view's data (the JSON of
// attnlab.tools.viz.view_to_dict: title, note, text, tokens, labels, layers[{name, heads, weights}]).
// Where the data comes from is up to the page: the offline page written by `attnlab viz --out
// FILE.html` embeds it as JSON in the script element with id "attn-data" (read at the end of this
// file); a page served by a local server can fetch it and call showAttention itself.
"use strict";

function showAttention(data) {
  const T = data.tokens.length;
  const $ = (id) => document.getElementById(id);
  const state = { layer: 0, head: 0, query: null, dir: "row", stretch: false };

  // White -> yellow -> orange -> red -> plum: a sequential scale readable in print and for most
  // colour-blind viewers; t in [0, 1].
  const STOPS = [[255, 255, 255], [254, 227, 145], [246, 134, 56], [190, 40, 40], [90, 10, 60]];
  function colour(t) {
    t = Math.min(1, Math.max(0, t || 0)) * (STOPS.length - 1);
    const i = Math.min(STOPS.length - 2, Math.floor(t)), f = t - i;
    const a = STOPS[i], b = STOPS[i + 1];
    return [0, 1, 2].map((k) => Math.round(a[k] + (b[k] - a[k]) * f));
  }
  const css = (rgb) => "rgb(" + rgb.join(", ") + ")";
  const W = () => data.layers[state.layer].weights[state.head];  // (T, T) of the selected head
  function headMax(w) { let m = 0; for (const row of w) for (const v of row) m = Math.max(m, v); return m || 1; }
  const scaleMax = () => (state.stretch ? headMax(W()) : 1);

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // ---- header and selects
  $("title").textContent = data.title || data.text;
  $("note").textContent = data.note;
  document.title = (data.title || "attention") + " · attnlab";
  const layerSel = $("layer-select"), headSel = $("head-select");
  data.layers.forEach((layer, i) => layerSel.appendChild(new Option(layer.name, String(i))));
  function fillHeads() {
    headSel.textContent = "";
    data.layers[state.layer].heads.forEach((h, i) => headSel.appendChild(new Option("head " + h, String(i))));
    headSel.value = String(state.head);
  }

  // ---- token strip
  const tokBox = $("tokens"), tokEls = [];
  data.labels.forEach((label, i) => {
    const t = el("span", "tok", label);
    t.tabIndex = 0;
    t.dataset.index = String(i);
    t.title = JSON.stringify(data.tokens[i]);
    const w = el("span", "w", "");
    t.appendChild(w);
    t.addEventListener("mouseenter", () => setQuery(i));
    t.addEventListener("focus", () => setQuery(i));
    tokBox.appendChild(t);
    tokEls.push({ tok: t, w: w });
  });

  // ---- the selected head's matrix
  const matrix = $("matrix");
  // Long prompts get small cells (the matrix stays about 700 px wide); below 7 px a label could
  // not be read, so the axes go unlabelled and each cell's tooltip names its tokens instead.
  const cellPx = Math.max(3, Math.min(34, Math.floor(700 / Math.max(T, 1))));
  const axisLabel = (j) => (cellPx >= 7 ? data.labels[j] : "");
  matrix.style.setProperty("--cell", cellPx + "px");
  matrix.style.fontSize = Math.min(12, cellPx - 1) + "px";  // labels no taller than a row
  const showNumbers = cellPx >= 30;
  matrix.style.gridTemplateColumns = "auto repeat(" + T + ", " + cellPx + "px)";
  const cells = [], rowLabs = [], colLabs = [];
  matrix.appendChild(el("div", "corner", ""));
  for (let j = 0; j < T; j++) {
    const c = el("div", "lab clab", axisLabel(j));
    colLabs.push(c); matrix.appendChild(c);
  }
  for (let i = 0; i < T; i++) {
    const r = el("div", "lab rlab", axisLabel(i));
    rowLabs.push(r); matrix.appendChild(r);
    const row = [];
    for (let j = 0; j < T; j++) {
      const c = el("div", "cell", "");
      c.dataset.q = String(i); c.dataset.k = String(j);
      c.addEventListener("mouseenter", () => setQuery(state.dir === "row" ? i : j));
      row.push(c); matrix.appendChild(c);
    }
    cells.push(row);
  }

  function drawMatrix() {
    const w = W(), m = scaleMax();
    for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {
      const c = cells[i][j];
      c.style.backgroundColor = css(colour(w[i][j] / m));
      c.dataset.weight = w[i][j].toFixed(4);
      if (showNumbers) {  // few tokens: print the weights, as the tutorials do
        c.textContent = w[i][j].toFixed(2);
        c.style.color = w[i][j] / m > 0.55 ? "white" : "#333";
      }
      c.title = data.labels[i] + " \u2192 " + data.labels[j] + ": " + w[i][j].toFixed(4);
    }
    const layer = data.layers[state.layer];
    $("matrix-title").textContent = layer.name + " \u00b7 head " + layer.heads[state.head];
    $("legend-max").textContent = m.toFixed(state.stretch ? 3 : 0);
  }

  // ---- hover: highlight intensity = weight
  function highlight() {
    const w = W(), m = scaleMax(), q = state.query;
    for (let j = 0; j < T; j++) {
      const { tok, w: wl } = tokEls[j];
      tok.classList.toggle("active", j === q);
      if (q === null) {
        tok.style.backgroundColor = "rgb(255, 255, 255)"; tok.dataset.weight = ""; wl.textContent = "";
        continue;
      }
      const v = state.dir === "row" ? w[q][j] : w[j][q];
      tok.style.backgroundColor = css(colour(v / m));
      tok.style.color = v / m > 0.6 ? "white" : "";
      tok.dataset.weight = v.toFixed(4);
      wl.textContent = v.toFixed(2);
    }
    for (let i = 0; i < T; i++) {
      rowLabs[i].classList.toggle("active", state.dir === "row" && i === q);
      colLabs[i].classList.toggle("active", state.dir === "col" && i === q);
      for (let j = 0; j < T; j++)
        cells[i][j].classList.toggle("on-path", q !== null && (state.dir === "row" ? i === q : j === q));
    }
    if (q === null) return;
    const label = JSON.stringify(data.tokens[q]);
    let best = 0;
    for (let j = 1; j < T; j++)
      if ((state.dir === "row" ? w[q][j] : w[j][q]) > (state.dir === "row" ? w[q][best] : w[best][q])) best = j;
    const bv = state.dir === "row" ? w[q][best] : w[best][q];
    const other = JSON.stringify(data.tokens[best]) + " (" + bv.toFixed(3) + ").";
    $("readout").textContent = "Token " + q + " " + label
      + (state.dir === "row" ? " attends most to token " : " is attended most by token ") + best + " " + other;
  }
  function setQuery(i) { state.query = i; highlight(); }

  // ---- thumbnails of every head, one row per layer
  const thumbs = $("thumbs"), thumbEls = [];
  const nCols = Math.max(...data.layers.map((l) => l.heads.length));
  thumbs.style.gridTemplateColumns = "auto repeat(" + nCols + ", auto)";
  data.layers.forEach((layer, li) => {
    thumbs.appendChild(el("div", "rowname", layer.name));
    const row = [];
    layer.heads.forEach((h, hi) => {
      const b = el("button", "thumb", "");
      b.type = "button";
      b.dataset.layer = String(li); b.dataset.head = String(hi);
      b.title = layer.name + " \u00b7 head " + h;
      const cv = document.createElement("canvas");
      cv.width = T; cv.height = T;
      const ctx = cv.getContext("2d"), img = ctx.createImageData(T, T), w = layer.weights[hi];
      for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {
        const rgb = colour(w[i][j]), p = 4 * (i * T + j);
        img.data[p] = rgb[0]; img.data[p + 1] = rgb[1]; img.data[p + 2] = rgb[2]; img.data[p + 3] = 255;
      }
      ctx.putImageData(img, 0, 0);
      b.appendChild(cv);
      b.appendChild(el("span", "", "head " + h));
      b.addEventListener("click", () => select(li, hi));
      row.push(b); thumbs.appendChild(b);
    });
    for (let k = layer.heads.length; k < nCols; k++) thumbs.appendChild(el("div", "", ""));
    thumbEls.push(row);
  });

  function select(layer, head) {
    const layerChanged = layer !== state.layer;
    state.layer = layer;
    state.head = Math.min(head, data.layers[layer].heads.length - 1);
    layerSel.value = String(state.layer);
    if (layerChanged || headSel.options.length === 0) fillHeads();
    headSel.value = String(state.head);
    thumbEls.forEach((row, li) => row.forEach((b, hi) =>
      b.classList.toggle("selected", li === state.layer && hi === state.head)));
    drawMatrix();
    highlight();
  }

  layerSel.addEventListener("change", () => select(Number(layerSel.value), state.head));
  headSel.addEventListener("change", () => select(state.layer, Number(headSel.value)));
  document.querySelectorAll('input[name="direction"]').forEach((r) =>
    r.addEventListener("change", () => { state.dir = r.value; highlight(); }));
  $("stretch").addEventListener("change", (e) => { state.stretch = e.target.checked; drawMatrix(); highlight(); });

  select(0, 0);
  document.body.dataset.ready = "1";
}

// The offline page: its data is embedded in the page.
(function () {
  const embedded = document.getElementById("attn-data");
  if (embedded) showAttention(JSON.parse(embedded.textContent));
})();
