// The circuit view of attnlab: the edges attnlab.interpret.edge_attribution scores (EAP, EAP-IG), drawn as a
// graph. The layers run top to bottom: the embeddings ("input"), then per layer its attention heads and its
// MLP, the logits last. An edge's width grows with |score| and its colour is its sign (red: patching it in
// moves the metric toward the clean run, blue: away from it); an edge into a head's query input is solid,
// into a key input dashed, into a value input dotted. Clicking a head shows its attention on both prompts.
//
// One view, three hosts, the data always the section of attnlab/interpret/circuit_view.py:
//   * the offline page of `attnlab circuit --out page.html` (its data in the element "attn-circuit");
//   * a tab of `attnlab serve`: the reader types the corrupted prompt and the answers, the server answers
//     POST api/circuit with the same section;
//   * Jupyter (notebook_circuit_html): the offline page in an iframe.
// On a served page this file is loaded after patching.js (which declares ATTNLAB_VIEWS) and before viewer.js,
// and registers the view there.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const CIRCUIT_STATE = { corrupted: null, answers: ["", ""], method: "EAP", budget: "5%" };

function cEl(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function cSvg(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

// A node's short name (TransformerLens's): input, a3.1, m2, logits; a reader's input as a3.1<q.
function nodeName(n) {
  const [kind, layer, head] = n;
  return { embed: "input", logits: "logits", attn_head_out: "a" + layer + "." + head, mlp_out: "m" + layer,
           mlp_in: "m" + layer, q_input: "a" + layer + "." + head + "<q", k_input: "a" + layer + ".kv" + head + "<k",
           v_input: "a" + layer + ".kv" + head + "<v" }[kind];
}

// White to red (positive) or blue (negative), for |v| / scale in [0, 1].
function signedRGB(v, scale) {
  const t = Math.min(1, Math.abs(v) / (scale || 1));
  const to = v >= 0 ? [201, 42, 42] : [59, 91, 219];
  return "rgb(" + to.map((c) => Math.round(255 + (c - 255) * t)).join(",") + ")";
}

class CircuitView {
  // ctx: {source, info, on(target, type, fn)} (showInspector's on a served page, or the page alone's)
  constructor(ctx) {
    this.source = ctx.source;
    this.on = ctx.on;
    const data = (this.source && this.source.data) || {};
    this.live = !!(ctx.info && ctx.info.live && this.source.api);
    this.data = data.circuit || null;  // a page's precomputed section
    this.available = this.live || !!this.data;
  }

  build() {
    const root = document.getElementById("view-circuit");
    root.textContent = "";
    root.classList.add("circuit");
    const $ = (this.$ = {});
    const add = (parent, tag, cls, text, id) => {
      const e = cEl(tag, cls, text);
      if (id) { e.id = id; $[id] = e; }
      parent.appendChild(e);
      return e;
    };
    add(root, "h2", "", "Circuit: edge attribution");
    add(root, "p", "note", "Every edge from a writer (the embeddings, a head's output, an MLP) to a later reader (a "
      + "head's query, key or value input, an MLP, the logits) is scored by how much patching it from the clean run "
      + "into the corrupted one moves the metric. Drawn are the strongest edges of the circuit: width by |score|, red "
      + "toward the clean run, blue away from it; into a query solid, a key dashed, a value dotted. Click a head for "
      + "its attention on both prompts.");
    if (this.live) {
      const form = add(root, "div", "circuit-form");
      add(form, "label", "", "Corrupted prompt (as many tokens as the prompt above: change a word or two)");
      const ta = add(form, "textarea", "", undefined, "circuit-corrupted");
      ta.rows = 2; ta.spellcheck = false; ta.setAttribute("aria-label", "corrupted prompt");
      const row = add(form, "div", "circuit-row");
      ["A", "B"].forEach((name, i) => {
        const label = add(row, "label", "", "Answer " + name + " ");
        const input = add(label, "input", "", undefined, "circuit-" + name.toLowerCase());
        input.type = "text"; input.placeholder = "one token, e.g. \u2423Paris"; input.spellcheck = false;
        input.setAttribute("aria-label", "answer " + name);
        input.value = CIRCUIT_STATE.answers[i];
        this.on(input, "input", () => { CIRCUIT_STATE.answers[i] = input.value; });
      });
      const mlabel = add(row, "label", "", "Method ");
      const method = add(mlabel, "select", "", undefined, "circuit-method");
      for (const m of ["EAP", "EAP-IG-inputs", "EAP-IG-activations"]) method.appendChild(new Option(m, m));
      method.value = CIRCUIT_STATE.method;
      this.on(method, "change", () => { CIRCUIT_STATE.method = method.value; });
      const blabel = add(row, "label", "", "Budget ");
      const budget = add(blabel, "input", "", undefined, "circuit-budget");
      budget.type = "text"; budget.value = CIRCUIT_STATE.budget; budget.style.width = "4rem";
      this.on(budget, "input", () => { CIRCUIT_STATE.budget = budget.value; });
      add(row, "button", "", "find the circuit", "circuit-run").type = "button";
      this.on($["circuit-run"], "click", () => this.run());
      this.on(ta, "input", () => { CIRCUIT_STATE.corrupted = ta.value; });
    }
    add(root, "p", "status", "", "circuit-status").setAttribute("role", "status");
    add(root, "p", "note", "", "circuit-summary");
    const body = add(root, "div", "circuit-body");
    const left = add(body, "div", "");
    add(left, "h3", "", "The circuit");
    add(left, "div", "circuit-graph", undefined, "circuit-graph");
    add(left, "p", "readout", "", "circuit-readout");
    const right = add(body, "div", "");
    add(right, "h3", "", "Faithfulness at MIB's edge budgets");
    add(right, "div", "", undefined, "circuit-curve");
    add(right, "h3", "", "The strongest edges");
    add(right, "table", "", undefined, "circuit-edges");
    add(root, "h3", "", "", "circuit-attn-title");
    add(root, "div", "circuit-attn", undefined, "circuit-attn");
    add(root, "p", "readout", "", "circuit-attn-readout");
  }

  async draw() {
    if (this.started) return;
    this.started = true;
    if (this.live) {
      const ta = this.$["circuit-corrupted"];
      ta.value = CIRCUIT_STATE.corrupted !== null ? CIRCUIT_STATE.corrupted : this.source.prompt;
      this.status("Type a corrupted prompt and two one-token answers, then find the circuit.");
      return;
    }
    this.show(this.data);
  }

  status(text, error) {
    const s = this.$["circuit-status"];
    s.textContent = text;
    s.classList.toggle("error", !!error);
  }

  async run() {
    const $ = this.$;
    const body = { clean: this.source.prompt, corrupted: $["circuit-corrupted"].value,
                   answers: [$["circuit-a"].value, $["circuit-b"].value], method: $["circuit-method"].value,
                   budget: $["circuit-budget"].value };
    $["circuit-run"].disabled = true;
    document.body.dataset.circuitRunning = "1";
    this.status("Scoring every edge and measuring the circuits\u2019 faithfulness\u2026");
    const t0 = performance.now();
    try {
      const d = await this.source.api.post("circuit", body);
      this.show(d);
      this.status("Answered in " + ((performance.now() - t0) / 1000).toFixed(1) + " s.");
      delete document.body.dataset.circuitError;
    } catch (err) {
      this.status(err.message, true);
      document.body.dataset.circuitError = err.message;
    } finally {
      $["circuit-run"].disabled = false;
      delete document.body.dataset.circuitRunning;
    }
  }

  show(d) {
    this.d = d;
    const $ = this.$, b = d.budget;
    $["circuit-summary"].textContent = "Metric " + d.metric + ", A = " + d.answers[0] + ", B = " + d.answers[1]
      + ": clean run " + d.clean_value.toFixed(4) + ", corrupted run " + d.corrupted_value.toFixed(4) + ". "
      + d.method + (d.method !== "EAP" ? " (" + d.ig_steps + " steps)" : "") + " over " + d.n_edges + " edges; the "
      + "circuit of the top " + +(b.fraction * 100).toFixed(3) + "% (" + b.n_edges + " edges) has faithfulness "
      + b.faithfulness.toFixed(4) + (d.edges.length < b.n_edges ? "; its " + d.edges.length + " strongest are drawn." : ".")
      + (d.pairs > 1 ? " The numbers are the mean over " + d.pairs + " pairs; the prompts and the attention shown are "
        + "the first pair's." : "");
    this.drawGraph(d);
    this.drawCurve(d.curve);
    this.drawTable(d.edges.slice(0, 20));
    $["circuit-attn-title"].textContent = "";
    $["circuit-attn"].textContent = "";
    document.body.dataset.circuitEdges = String(d.edges.length);
  }

  // ---- the graph ----------------------------------------------------------------------------------------
  drawGraph(d) {
    const H = d.n_heads, group = H / d.n_kv_heads, $ = this.$;
    // The nodes the drawn edges touch, by row: 0 = input, 2l + 1 = layer l's heads, 2l + 2 = its MLP, last = logits.
    const lastRow = 2 * d.n_layers + 1;
    const heads = new Set(), mlps = new Set();
    for (const [w, r] of d.edges) {
      if (w[0] === "attn_head_out") heads.add(w[1] + "." + w[2]);
      if (w[0] === "mlp_out") mlps.add(w[1]);
      if (r[0] === "q_input") heads.add(r[1] + "." + r[2]);
      if (r[0] === "mlp_in") mlps.add(r[1]);
    }
    // a key/value input feeds its group's query heads: those drawn, else the group's first
    const kvTargets = (layer, g) => {
      const inGroup = [];
      for (let i = 0; i < group; i++) if (heads.has(layer + "." + (g * group + i))) inGroup.push(g * group + i);
      return inGroup.length ? inGroup : [g * group];
    };
    for (const [, r] of d.edges)
      if (r[0] === "k_input" || r[0] === "v_input") for (const h of kvTargets(r[1], r[2])) heads.add(r[1] + "." + h);
    const rows = new Set([0, lastRow]);
    for (const k of heads) rows.add(2 * Number(k.split(".")[0]) + 1);
    for (const l of mlps) rows.add(2 * l + 2);
    const order = Array.from(rows).sort((a, b) => a - b), rowY = new Map();
    const DX = 44, DY = 46, X0 = 60, Y0 = 24;
    order.forEach((row, i) => rowY.set(row, Y0 + i * DY));
    const width = X0 + (H + 2) * DX + 40, height = Y0 + order.length * DY;
    const pos = new Map();  // node key -> [x, y]
    // the input and the logits in a column of their own, right of the MLPs: the direct path between them
    // (often the strongest edge) then crosses no head
    pos.set("input", [X0 + (H + 1.7) * DX, rowY.get(0)]);
    pos.set("logits", [X0 + (H + 1.7) * DX, rowY.get(lastRow)]);
    for (const k of heads) {
      const [l, h] = k.split(".").map(Number);
      pos.set("a" + k, [X0 + h * DX, rowY.get(2 * l + 1)]);
    }
    for (const l of mlps) pos.set("m" + l, [X0 + (H + 0.5) * DX, rowY.get(2 * l + 2)]);
    const svg = cSvg("svg", { width: width, height: height, viewBox: "0 0 " + width + " " + height, role: "img",
                              "aria-label": "the circuit's graph" });
    for (const row of order) {  // the layers' names at the left
      const label = row === 0 ? "input" : row === lastRow ? "logits"
        : (row % 2 ? "L" + (row - 1) / 2 + " attn" : "L" + (row - 2) / 2 + " mlp");
      svg.appendChild(cSvg("text", { x: 4, y: rowY.get(row) + 4 }, label));
    }
    const scale = Math.max(1e-12, ...d.edges.map((e) => Math.abs(e[2])));
    const writerKey = (w) => (w[0] === "embed" ? "input" : w[0] === "mlp_out" ? "m" + w[1] : "a" + w[1] + "." + w[2]);
    const readerKeys = (r) => {
      if (r[0] === "logits") return ["logits"];
      if (r[0] === "mlp_in") return ["m" + r[1]];
      if (r[0] === "q_input") return ["a" + r[1] + "." + r[2]];
      return kvTargets(r[1], r[2]).map((h) => "a" + r[1] + "." + h);
    };
    const readout = $["circuit-readout"];
    const edges = cSvg("g", { class: "edges" });
    for (const [w, r, s] of d.edges) {
      const [x1, y1] = pos.get(writerKey(w));
      for (const key of readerKeys(r)) {
        const [x2, y2] = pos.get(key);
        const bend = Math.max(14, (y2 - y1) / 2);
        const path = cSvg("path", {
          d: "M" + x1 + "," + (y1 + 9) + " C" + x1 + "," + (y1 + bend) + " " + x2 + "," + (y2 - bend) + " " + x2 + "," + (y2 - 9),
          class: "edge " + (r[0] === "k_input" ? "k" : r[0] === "v_input" ? "v" : "q"),
          stroke: signedRGB(s, scale * 0.5), "stroke-width": (0.6 + 5 * Math.abs(s) / scale).toFixed(2),
        });
        const say = nodeName(w) + " \u2192 " + nodeName(r) + ": " + (s >= 0 ? "+" : "") + s.toPrecision(4);
        path.appendChild(cSvg("title", {}, say));
        path.dataset.score = String(s);
        this.on(path, "mouseenter", () => { readout.textContent = say; });
        edges.appendChild(path);
      }
    }
    svg.appendChild(edges);
    for (const [key, [x, y]] of pos) {
      const g = cSvg("g", { class: "node" + (key[0] === "a" ? " head" : ""), transform: "translate(" + x + "," + y + ")" });
      g.dataset.node = key;
      if (key[0] === "a") {
        g.appendChild(cSvg("circle", { r: 9 }));
        g.setAttribute("tabindex", "0");
        g.setAttribute("role", "button");
        const [l, h] = key.slice(1).split(".").map(Number);
        this.on(g, "click", () => this.selectHead(l, h));
        this.on(g, "keydown", (e) => { if (e.key === "Enter" || e.key === " ") this.selectHead(l, h); });
      } else {
        g.appendChild(cSvg("rect", { x: key === "input" || key === "logits" ? -26 : -14, y: -9,
                                     width: key === "input" || key === "logits" ? 52 : 28, height: 18, rx: 4 }));
      }
      g.appendChild(cSvg("text", { x: 0, y: key[0] === "a" ? -12 : 4, "text-anchor": "middle" },
                         key[0] === "a" ? key.slice(1) : key));
      g.appendChild(cSvg("title", {}, key[0] === "a" ? "head " + key.slice(1) + ": click for its attention" : key));
      svg.appendChild(g);
    }
    $["circuit-graph"].replaceChildren(svg);
    this.svg = svg;
  }

  drawCurve(c) {
    const W = 320, Hh = 170, L = 40, B = 26, n = c.budgets.length;
    const lo = Math.min(0, ...c.faithfulness), hi = Math.max(1, ...c.faithfulness);
    const x = (i) => L + (i / Math.max(1, n - 1)) * (W - L - 10);  // budgets evenly spaced (they grow ~x2.5)
    const y = (v) => 8 + (1 - (v - lo) / (hi - lo)) * (Hh - B - 8);
    const svg = cSvg("svg", { width: W, height: Hh, role: "img", "aria-label": "faithfulness curve" });
    svg.appendChild(cSvg("line", { x1: L, x2: W - 10, y1: y(1), y2: y(1), stroke: "#d9dee5" }));
    svg.appendChild(cSvg("line", { x1: L, x2: W - 10, y1: y(0), y2: y(0), stroke: "#d9dee5" }));
    svg.appendChild(cSvg("text", { x: 4, y: y(1) + 4 }, "1"));
    svg.appendChild(cSvg("text", { x: 4, y: y(0) + 4 }, "0"));
    svg.appendChild(cSvg("polyline", { points: c.faithfulness.map((v, i) => x(i) + "," + y(v)).join(" "),
                                       fill: "none", stroke: "#d9480f", "stroke-width": 2 }));
    c.budgets.forEach((bud, i) => {
      const dot = cSvg("circle", { cx: x(i), cy: y(c.faithfulness[i]), r: 3, fill: "#d9480f" });
      dot.appendChild(cSvg("title", {}, +(bud * 100).toFixed(3) + "% (" + c.n_edges[i] + " edges): "
        + c.faithfulness[i].toFixed(4)));
      svg.appendChild(dot);
      if (i % 2 === 0) svg.appendChild(cSvg("text", { x: x(i), y: Hh - 8, "text-anchor": "middle" }, +(bud * 100).toFixed(1) + "%"));
    });
    const note = cEl("p", "note", "CPR (area under the curve) " + c.cpr.toFixed(5) + ", CMD (area between it and 1) "
      + c.cmd.toFixed(5) + ".");
    this.$["circuit-curve"].replaceChildren(svg, note);
  }

  drawTable(edges) {
    const rows = [cEl("tr")];
    for (const h of ["writer", "reader", "score"]) rows[0].appendChild(cEl("th", "", h));
    for (const [w, r, s] of edges) {
      const tr = cEl("tr");
      tr.appendChild(cEl("td", "name", nodeName(w)));
      tr.appendChild(cEl("td", "name", nodeName(r)));
      tr.appendChild(cEl("td", "", (s >= 0 ? "+" : "") + s.toPrecision(4)));
      rows.push(tr);
    }
    this.$["circuit-edges"].replaceChildren(...rows);
  }

  // ---- a head's attention on both prompts ---------------------------------------------------------------
  selectHead(layer, head) {
    const $ = this.$, d = this.d, key = layer + "." + head;
    this.svg.querySelectorAll(".node.head").forEach((n) => n.classList.toggle("selected", n.dataset.node === "a" + key));
    $["circuit-attn-title"].textContent = "Layer " + layer + " \u00b7 head " + head + ": its attention on both prompts";
    const pats = d.patterns && d.patterns[key];
    if (!pats) {
      $["circuit-attn"].textContent = "";
      $["circuit-attn-readout"].textContent = "This page does not hold that head's attention"
        + (d.patterns_note ? ": " + d.patterns_note : "") + ".";
      return;
    }
    const panes = [];
    for (const which of ["clean", "corrupted"]) {
      const pane = cEl("section", "pane");
      pane.dataset.prompt = which;
      pane.appendChild(cEl("h3", "", "on the " + which + " prompt"));
      pane.appendChild(this.heatmap(pats[which], d[which].tokens, which));
      panes.push(pane);
    }
    $["circuit-attn"].replaceChildren(...panes);
    $["circuit-attn-readout"].textContent = "Hover a cell: the query's token \u2192 the key's, and the weight.";
    document.body.dataset.circuitHead = key;
  }

  heatmap(W, tokens, which) {
    const T = W.length, C = Math.max(6, Math.min(22, Math.floor(360 / T))), M = 90;
    const svg = cSvg("svg", { width: M + T * C + 4, height: M + T * C + 4, role: "img",
                              "aria-label": "attention on the " + which + " prompt" });
    const readout = this.$["circuit-attn-readout"];
    for (let i = 0; i < T; i++) {
      svg.appendChild(cSvg("text", { x: M - 4, y: M + i * C + C * 0.7, "text-anchor": "end" }, tokens[i]));
      const t = cSvg("text", { x: 0, y: 0, transform: "translate(" + (M + i * C + C * 0.7) + "," + (M - 4) + ") rotate(-60)" }, tokens[i]);
      svg.appendChild(t);
      for (let j = 0; j < T; j++) {
        const v = W[i][j];
        const cell = cSvg("rect", { x: M + j * C, y: M + i * C, width: C - 1, height: C - 1, fill: signedRGB(v, 1),
                                    class: "cell" });
        const say = which + ": " + tokens[i] + " \u2192 " + tokens[j] + ": " + v.toFixed(4);
        cell.appendChild(cSvg("title", {}, say));
        this.on(cell, "mouseenter", () => { readout.textContent = say; });
        svg.appendChild(cell);
      }
    }
    return svg;
  }
}

if (typeof ATTNLAB_VIEWS !== "undefined") ATTNLAB_VIEWS.circuit = (ctx) => new CircuitView(ctx);

// The view alone (circuit.html: the command line's page, and Jupyter's), its data embedded in the page.
document.addEventListener("DOMContentLoaded", () => {
  const embedded = document.getElementById("attn-circuit");
  if (!embedded) return;
  const status = document.getElementById("status");
  try {
    const data = JSON.parse(embedded.textContent);
    const view = new CircuitView({ source: { data: { circuit: data } }, info: null,
                                   on: (t, type, fn) => t.addEventListener(type, fn) });
    view.build();
    view.draw();
    status.textContent = "";
    document.body.dataset.ready = "1";
  } catch (err) {
    status.textContent = "The page could not be shown: " + err.message;
    document.body.dataset.error = String(err.message);
    throw err;
  }
});
