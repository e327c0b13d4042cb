// The patching view of the attnlab inspector: activation patching (attnlab.interpret.activation_patching).
// The corrupted prompt runs with one activation of the clean run patched in, for every head (layer x
// head: a head's output at every position) and every residual-stream position (layer x position); each
// cell shows the metric logit(A) - logit(B) at the last token of that patched run as the fraction of the
// clean run's value it restores (0: as the corrupted run, 1: as the clean run; blue below 0, red above),
// the metric itself on hover. Clicking a head shows its attention pattern on both prompts.
//
// One view, three hosts, the data always the section of attnlab/interpret/patch_view.py:
//   * the inspector page of `attnlab viz --corrupted TEXT --answers A B` (source.data.patching: static);
//   * the live page of `attnlab serve`: the reader types the corrupted prompt and picks the answers, the
//     server answers POST api/patch (the same section, one head's pattern at a time);
//   * a PatchReport in Jupyter: patching.html, this view alone (its data in the element "attn-patch").
// This file is loaded before viewer.js (whose Heatmap, EmbeddedSource, el, divRGB, seqRGB it uses when
// it runs) and registers the view in ATTNLAB_VIEWS, where showInspector finds it.
"use strict";

const ATTNLAB_VIEWS = {};

// What the reader chose on a live page; the views are drawn anew for every prompt typed, this stays.
const PATCH_STATE = { corrupted: null, answers: [null, null], result: null, request: null, head: null, runs: 0 };

const SITE_TITLES = {
  head_out: ["Each head's output", "patched at every position (hook_z): layer \u00d7 head; click a head for its pattern"],
  resid_pre: ["The residual stream", "entering each layer, patched at one position (hook_resid_pre): layer \u00d7 position"],
};

class PatchingView {
  // ctx: {source, info, on(target, type, fn), signal, paintStrip} (showInspector's, or the page alone's)
  constructor(ctx) {
    this.source = ctx.source;
    this.on = ctx.on;
    this.signal = ctx.signal;
    this.paintStrip = ctx.paintStrip || (() => {});
    const data = this.source.data || {};
    this.live = !!(ctx.info && ctx.info.live && this.source.api);
    this.data = data.patching || null;  // a page's precomputed section
    this.available = this.live || !!this.data;
    this.patterns = new Map();  // "layer.head" -> Promise of {clean, corrupted} (a live page asks the server)
  }

  // ---- the form and the panes -----------------------------------------------------------------------
  build() {
    const root = document.getElementById("view-patching");
    root.textContent = "";
    root.classList.add("patching");
    const $ = (this.$ = {});
    const add = (parent, tag, cls, text, id) => {
      const e = el(tag, cls, text);
      if (id) { e.id = id; $[id] = e; }
      parent.appendChild(e);
      return e;
    };
    add(root, "h2", "", "Activation patching");
    add(root, "p", "note", "The corrupted prompt runs again with one activation taken from the clean run: a head's "
      + "output, or the residual stream at one position. Each cell shows how much of the clean run's metric that "
      + "patch restores (0: as the corrupted run, 1: as the clean one; hover for the metric itself). Heads and "
      + "positions that restore much carry what tells A from B.");
    const form = add(root, "div", "patch-form");
    const clean = add(form, "label", "patch-label", "Clean prompt ");
    add(clean, "small", "", this.live ? "(the prompt above)" : "");
    add(form, "textarea", "", undefined, "patch-clean");
    $["patch-clean"].rows = 2; $["patch-clean"].readOnly = true; $["patch-clean"].spellcheck = false;
    const corr = add(form, "label", "patch-label", "Corrupted prompt ");
    add(corr, "small", "", this.live ? "(as many tokens as the clean one: change a word or two)" : "");
    add(form, "textarea", "", undefined, "patch-corrupted");
    $["patch-corrupted"].rows = 2; $["patch-corrupted"].spellcheck = false;
    $["patch-corrupted"].setAttribute("aria-label", "corrupted prompt");
    add(form, "p", "status", "", "patch-count");
    const row = add(form, "div", "patch-row");
    ["A", "B"].forEach((name, i) => {
      const label = add(row, "label", "", "Answer " + name + " ");
      const sel = add(label, "select", "", undefined, "patch-" + name.toLowerCase());
      sel.setAttribute("aria-label", "answer " + name);
      const text = add(label, "input", "", undefined, "patch-" + name.toLowerCase() + "-text");
      text.type = "text"; text.placeholder = "one token, e.g. \u2423Paris"; text.hidden = true; text.spellcheck = false;
      text.setAttribute("aria-label", "answer " + name + " as text");
      this.on(sel, "change", () => {
        text.hidden = sel.value !== "text";
        if (!text.hidden) text.focus();
        PATCH_STATE.answers[i] = this.choice(i);
      });
      this.on(text, "input", () => { PATCH_STATE.answers[i] = this.choice(i); });
    });
    add(row, "button", "", "patch", "patch-run").type = "button";
    add(row, "button", "", "stop", "patch-stop").type = "button";
    $["patch-stop"].disabled = true;
    add(form, "p", "status", "", "patch-status").setAttribute("role", "status");
    add(root, "p", "note", "", "patch-summary");
    add(root, "div", "patch-maps", undefined, "patch-maps");
    add(root, "p", "readout", "", "patch-readout");
    add(root, "h3", "", "", "patch-pattern-title");
    const pats = add(root, "div", "patch-patterns");
    for (const which of ["clean", "corrupted"]) {
      const pane = add(pats, "section", "pane");
      add(pane, "h3", "", "", "patch-pattern-" + which + "-title");
      add(pane, "div", "matrix", undefined, "patch-pattern-" + which);
    }
    add(root, "p", "readout", "", "patch-pattern-readout");

    if (this.live) {
      this.on($["patch-run"], "click", () => this.run());
      this.on($["patch-stop"], "click", () => this.stop());
      this.on($["patch-corrupted"], "input", () => {
        PATCH_STATE.corrupted = $["patch-corrupted"].value;
        clearTimeout(this.countTimer);
        this.countTimer = setTimeout(() => this.count(), 300);
      });
      if (this.signal) this.signal.addEventListener("abort", () => this.stop());
    } else {
      $["patch-corrupted"].disabled = true;
      $["patch-run"].hidden = true; $["patch-stop"].hidden = true;
      $["patch-a"].disabled = true; $["patch-b"].disabled = true;
      add(form, "p", "note patch-static", "This page is static: the patching was computed when the page was "
        + "written, for this corrupted prompt and these answers. To type another corrupted prompt or pick other "
        + "answers, run attnlab serve with the model (its Patching tab).");
    }
  }

  async draw(what) {
    this.paintStrip(null);
    if (this.started) return;  // drawn once; the reader's actions redraw parts of it
    this.started = true;
    const $ = this.$;
    if (!this.live) {
      const d = this.data;
      $["patch-clean"].value = d.clean.text;
      $["patch-corrupted"].value = d.corrupted.text;
      d.answers.forEach((a, i) => {
        const sel = $[i ? "patch-b" : "patch-a"];
        sel.appendChild(new Option(a.label, String(a.id)));
      });
      $["patch-count"].textContent = d.clean.ids.length + " tokens each.";
      this.show(this.parse(d), null);
      return;
    }
    const prompt = this.source.prompt, tokens = this.source.data.tokens.length;
    $["patch-clean"].value = prompt;
    $["patch-corrupted"].value = PATCH_STATE.corrupted !== null ? PATCH_STATE.corrupted : prompt;
    this.cleanTokens = tokens;
    this.count();
    await this.candidates();
    const last = PATCH_STATE.result;
    if (last && PATCH_STATE.request.clean === prompt) this.show(this.parse(last), PATCH_STATE.request);
    else this.status(PATCH_STATE.result ? "The clean prompt changed: press \u201cpatch\u201d again." :
      "Edit the corrupted prompt (as many tokens as the clean one), pick two answers, press \u201cpatch\u201d.");
  }

  status(text, error) {
    const s = this.$["patch-status"];
    s.textContent = text;
    s.classList.toggle("error", !!error);
  }

  // ---- the answers: the clean run's likeliest next tokens, or a text of one token --------------------
  async candidates() {
    const $ = this.$;
    let r;
    try {
      r = await this.source.api.post("next", { prompt: this.source.prompt, position: -1, temperature: 1, k: 10 });
    } catch (err) {
      this.status(err.message, true);
      r = { ids: [], probs: [], labels: {} };
    }
    this.source.learn(r.labels);
    const options = r.ids.map((id, j) => ({ id: id, label: r.labels[String(id)], p: r.probs[j] }));
    [$["patch-a"], $["patch-b"]].forEach((sel, i) => {
      sel.textContent = "";
      const kept = PATCH_STATE.answers[i];
      const list = options.slice();
      if (kept && kept.id !== undefined && !list.some((o) => o.id === kept.id)) list.push(kept);
      for (const o of list)
        sel.appendChild(new Option(o.label + (o.p !== undefined ? "   p = " + o.p.toFixed(3) : ""), String(o.id)));
      sel.appendChild(new Option("other: type one token\u2026", "text"));
      const text = $[sel.id + "-text"];
      if (kept && kept.text !== undefined) { sel.value = "text"; text.value = kept.text; }
      else if (kept && kept.id !== undefined) sel.value = String(kept.id);
      else sel.value = list.length > i ? String(list[i].id) : "text";
      text.hidden = sel.value !== "text";
      PATCH_STATE.answers[i] = this.choice(i);
    });
  }
  choice(i) {  // {id, label} or {text}
    const sel = this.$[i ? "patch-b" : "patch-a"];
    if (sel.value === "text") return { text: this.$[sel.id + "-text"].value };
    return { id: Number(sel.value), label: this.source.label(Number(sel.value)) };
  }

  async count() {  // the corrupted prompt's tokens against the clean one's
    const text = this.$["patch-corrupted"].value, box = this.$["patch-count"];
    if (!text) { box.textContent = ""; return; }
    try {
      const r = await this.source.api.post("tokenize", { prompt: text });
      if (this.$["patch-corrupted"].value !== text) return;
      const n = r.ids.length, m = this.cleanTokens;
      box.textContent = n === m ? "Clean and corrupted prompts: " + n + " tokens each."
        : "The corrupted prompt is " + n + " tokens, the clean one " + m + ": patching pairs positions, they must match.";
      box.classList.toggle("error", n !== m);
    } catch (err) {
      box.textContent = err.message;
      box.classList.add("error");
    }
  }

  // ---- asking the server ---------------------------------------------------------------------------
  async run() {
    const $ = this.$;
    const answers = [0, 1].map((i) => this.choice(i));
    for (let i = 0; i < 2; i++)
      if (answers[i].text !== undefined && !answers[i].text) {
        this.status("Type answer " + "AB"[i] + " (one token) or pick one of the likeliest.", true);
        return;
      }
    const body = { clean: this.source.prompt, corrupted: $["patch-corrupted"].value,
                   answers: answers.map((a) => (a.text !== undefined ? a.text : a.id)) };
    this.stop();
    const ctl = (this.ctl = new AbortController());
    $["patch-run"].disabled = true; $["patch-stop"].disabled = false;
    document.body.dataset.patching = "1";
    const info = this.source.data.model || {};
    this.status("Patching every head and every position: " + (info.n_layers && info.n_heads
      ? info.n_layers * info.n_heads + " + " + info.n_layers * this.cleanTokens + " runs of the model" : "")
      + "\u2026 (the other views stay live meanwhile)");
    const t0 = performance.now();
    try {
      const r = await this.source.api.post("patch", body, ctl.signal);
      PATCH_STATE.result = r; PATCH_STATE.request = body; PATCH_STATE.head = null;
      this.patterns.clear();
      this.show(this.parse(r), body);
      this.status("Answered in " + ((performance.now() - t0) / 1000).toFixed(1) + " s.");
      delete document.body.dataset.patchError;
    } catch (err) {
      if (err.name === "AbortError") { this.status("Stopped."); return; }
      this.status(err.message, true);
      document.body.dataset.patchError = err.message;
    } finally {
      if (this.ctl === ctl) {
        this.ctl = null;
        $["patch-run"].disabled = false; $["patch-stop"].disabled = true;
        delete document.body.dataset.patching;
      }
    }
  }
  stop() {
    if (!this.ctl) return;
    this.ctl.abort();  // the server stops between the sites
    this.ctl = null;
    this.$["patch-run"].disabled = false; this.$["patch-stop"].disabled = true;
    delete document.body.dataset.patching;
  }

  // ---- drawing a result ----------------------------------------------------------------------------
  parse(d) {
    const arr = (desc) => this.source.arr(desc);
    const sites = {};
    for (const name of Object.keys(d.sites)) sites[name] = arr(d.sites[name]);
    return { d: d, sites: sites,
             patterns: d.patterns ? { clean: arr(d.patterns.clean), corrupted: arr(d.patterns.corrupted) } : null };
  }

  show(res, request) {
    const $ = this.$, d = res.d, c = d.clean_value, x = d.corrupted_value, span = c - x;
    const norm = Math.abs(span) > 1e-9;
    const restored = (v) => (norm ? (v - x) / span : v - x);
    this.res = res; this.request = request;
    const A = d.answers[0].label, B = d.answers[1].label;
    $["patch-summary"].textContent = "Metric: logit(" + A + ") \u2212 logit(" + B + ") at the last token: "
      + fmt(c, 4) + " on the clean prompt, " + fmt(x, 4) + " on the corrupted one."
      + (norm ? "" : " They are equal, so nothing can be restored: the colours show each patch's change instead.");
    const box = $["patch-maps"], L = d.n_layers, T = d.clean.ids.length;
    box.textContent = "";
    this.heads = null;
    const readout = $["patch-readout"];
    const cl = d.clean.labels, xl = d.corrupted.labels;
    const posLabel = (j) => (cl[j] === xl[j] ? cl[j] : cl[j] + "\u2192" + xl[j]);
    for (const name of Object.keys(res.sites)) {
      const kind = d.kinds[name], a = res.sites[name], C = a.cols;
      const pane = el("section", "pane patch-site");
      pane.dataset.site = name;
      const [title, sub] = SITE_TITLES[name] || [name, kind === "head" ? "layer \u00d7 head" : "layer \u00d7 position"];
      const h = el("h3", "", title + " ");
      h.appendChild(el("small", "", sub));
      pane.appendChild(h);
      const grid = el("div", "matrix patch-map");
      grid.id = "patch-" + name;
      pane.appendChild(grid);
      box.appendChild(pane);
      const rowPx = Math.max(6, Math.min(26, Math.floor(520 / Math.max(L, 1))));
      const cell = kind === "head" ? rowPx : Math.max(4, Math.min(rowPx, Math.floor(760 / Math.max(C, 1))));
      const where = (i, j) => "layer " + i + (kind === "head" ? ", head " + j : ", position " + j + " " + posLabel(j));
      const say = (i, j, v) => where(i, j) + ": " + fmt(v, 4) + (norm ? " (restores " + fmt(restored(v), 3) + ")"
        : " (change " + fmt(restored(v), 4) + ")");
      // Cells show the fraction restored (data-restored), and keep the metric itself (data-value).
      const map = new Heatmap(grid, {
        rows: L, cols: C, cellPx: cell, key: "restored", digits: 3, numbers: true,
        rowLabel: (i) => String(i),
        colLabel: (j) => (kind === "head" ? String(j) : posLabel(j)),
        onHover: (i, j) => { readout.textContent = say(i, j, a.at(i * C + j)); },
      });
      const raw = a.all(), shown = raw.map(restored);
      let lim = 1e-6;  // each map its own scale, symmetric about 0 (white: as the corrupted run)
      for (const r of shown) lim = Math.max(lim, Math.abs(r));
      map.draw(shown, (r) => divRGB(r / lim), (i, j) => say(i, j, raw[i * C + j]));
      const legend = el("div", "legend");
      legend.appendChild(el("span", "", fmt(-lim, 2)));
      legend.appendChild(el("span", "bar diverging"));
      legend.appendChild(el("span", "", fmt(lim, 2)));
      legend.appendChild(el("span", "", norm ? "fraction restored" : "change"));
      pane.appendChild(legend);
      if (map.dom) map.cells.forEach((row, i) => row.forEach((c, j) => { c.dataset.value = String(raw[i * C + j]); }));
      if (map.dom && kind === "pos") map.colLabs.forEach((lab, j) => lab.classList.toggle("changed", cl[j] !== xl[j]));
      if (kind === "head") {
        this.heads = { map: map, H: C };
        grid.classList.add("clickable");
        grid.addEventListener("click", (e) => {
          const target = e.target.closest ? e.target.closest(".cell") : null;
          if (target) this.selectHead(Number(target.dataset.q), Number(target.dataset.k));
        });
      }
    }
    document.body.dataset.patchReady = String(++PATCH_STATE.runs);
    // The head that restores the most, unless the reader chose one.
    const hs = d.kinds.head_out === "head" ? "head_out" : Object.keys(d.kinds).find((s) => d.kinds[s] === "head");
    if (!hs) { $["patch-pattern-title"].textContent = ""; return; }
    let best = 0;
    const vals = res.sites[hs].all();
    for (let p = 1; p < vals.length; p++) if (restored(vals[p]) > restored(vals[best])) best = p;
    const H = res.sites[hs].cols, keep = PATCH_STATE.head;
    if (keep && keep[0] < L && keep[1] < H) this.selectHead(keep[0], keep[1]);
    else this.selectHead(Math.floor(best / H), best % H);
  }

  async selectHead(layer, head) {
    const $ = this.$, res = this.res, d = res.d, key = layer + "." + head;
    PATCH_STATE.head = [layer, head];
    if (this.heads && this.heads.map.dom)
      this.heads.map.cells.forEach((row, i) => row.forEach((c, j) => c.classList.toggle("selected", i === layer && j === head)));
    $["patch-pattern-title"].textContent = "Layer " + layer + " \u00b7 head " + head + ": its attention on both prompts";
    let pats;
    if (res.patterns) {
      const H = res.patterns.clean.shape[1], k = layer * H + head;
      pats = { clean: res.patterns.clean.matrix(k), corrupted: res.patterns.corrupted.matrix(k) };
    } else if (this.live && this.request) {
      if (!this.patterns.has(key)) {
        const p = this.source.api.post("patch", Object.assign({}, this.request, { sites: [], head: key }))
          .then((r) => ({ clean: this.source.arr(r.pattern.clean).matrix(0),
                          corrupted: this.source.arr(r.pattern.corrupted).matrix(0) }));
        p.catch(() => this.patterns.delete(key));
        this.patterns.set(key, p);
      }
      try {
        pats = await this.patterns.get(key);
      } catch (err) {
        $["patch-pattern-readout"].textContent = err.message;
        return;
      }
      if (PATCH_STATE.head[0] !== layer || PATCH_STATE.head[1] !== head || this.res !== res) return;  // clicked on
    } else {
      $["patch-pattern-readout"].textContent = "This page does not hold the heads' patterns"
        + (d.patterns_note ? ": " + d.patterns_note : "") + ".";
      return;
    }
    const T = d.clean.ids.length, readout = $["patch-pattern-readout"];
    for (const which of ["clean", "corrupted"]) {
      const labels = d[which].labels, W = pats[which];
      $["patch-pattern-" + which + "-title"].textContent = "on the " + which + " prompt";
      const say = (i, j, v) => which + ": " + labels[i] + " \u2192 " + labels[j] + ": " + fmt(v, 4);
      const map = new Heatmap($["patch-pattern-" + which], {
        rows: T, cols: T, key: "weight", width: 420, rowLabel: (i) => labels[i], colLabel: (j) => labels[j],
        onHover: (i, j) => { readout.textContent = say(i, j, W[i * T + j]); },
      });
      map.draw(W, (v) => seqRGB(v), say);
    }
    document.body.dataset.patchPattern = key;
  }
}

ATTNLAB_VIEWS.patching = (ctx) => new PatchingView(ctx);

// The view alone (patching.html: a PatchReport in Jupyter), its data embedded in the page. Run once
// every script of the page is there (viewer.js comes after this file).
document.addEventListener("DOMContentLoaded", () => {
  const embedded = document.getElementById("attn-patch");
  if (!embedded) return;
  const status = document.getElementById("status");
  new EmbeddedSource(JSON.parse(embedded.textContent)).open().then(async (source) => {
    const view = new PatchingView({ source: source, info: null, on: (t, type, fn) => t.addEventListener(type, fn) });
    view.build();
    await view.draw("view");
    status.textContent = "";
    document.body.dataset.ready = "1";
  }).catch((err) => {
    status.textContent = "The page could not be shown: " + err.message;
    document.body.dataset.error = String(err.message);
    throw err;
  });
});
