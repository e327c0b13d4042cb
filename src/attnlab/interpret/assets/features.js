// The Features view of the attnlab inspector: what a sparse autoencoder (SAE) reads in the prompt.
// Hover or click a token above: its strongest latents (attnlab.interpret.sae_view.strongest_latents),
// largest first. Click a latent: its activation shades the tokens above, and its dashboard follows (top
// contexts, activation histogram, density, promoted and suppressed tokens: SAE_DASHBOARD.latentView of
// sae_dashboard.js, loaded before this file), over the prompt or over a corpus.
//
// One view, two hosts:
//   * the offline page of `attnlab viz --sae DIR --out page.html`: source.data.features, one section of
//     sae_view.features_section per SAE, every number computed when the page was written (steering needs
//     the model: the view says where to find it);
//   * the Features tab of `attnlab serve --sae DIR`: the server answers POST api/features (a prompt's
//     latents), api/latent (one latent's activation and dashboard) and api/steer (a generation with
//     latents' directions added, beside the same generation without them).
// This file is loaded before viewer.js and declares FeaturesView, which showInspector adds.
"use strict";

// What the reader chose; a live page draws the views anew for every prompt typed, this stays.
const FEATURES_STATE = { sae: 0, latent: null, over: "prompt", steer: [{ latent: "", strength: 8 }], tokens: 16,
                         temperature: 0, corpusRead: {} };

class FeaturesView {
  // ctx: showInspector's {source, info, on(target, type, fn), paintStrip, state, redraw}
  constructor(ctx) {
    this.source = ctx.source;
    this.on = ctx.on;
    this.paintStrip = ctx.paintStrip || (() => {});
    this.state = ctx.state || {};
    this.redraw = ctx.redraw || (() => {});
    const data = this.source.data || {};
    this.live = !!(ctx.info && ctx.info.live && this.source.api);
    const shared = this.source.shared && this.source.shared.info;
    this.saes = this.live ? ((shared && shared.saes) || []) : (data.features || []);
    this.corpus = this.live ? (shared && shared.sae_corpus) || null : null;
    this.T = (data.tokens || []).length;
    this.available = this.saes.length > 0;
    this.answers = new Map();  // a live page's answers for this prompt, by request
    if (FEATURES_STATE.sae >= this.saes.length) FEATURES_STATE.sae = 0;
  }

  // ---- the data: embedded (offline) or asked for (live) -----------------------------------------------
  ask(path, body) {
    const key = path + JSON.stringify(body);
    if (!this.answers.has(key)) {
      const p = this.source.api.post(path, Object.assign({ prompt: this.source.prompt }, body));
      p.catch(() => this.answers.delete(key));
      this.answers.set(key, p);
    }
    return this.answers.get(key);
  }
  section() { return this.live ? null : this.saes[FEATURES_STATE.sae]; }
  corpusOf() {  // {name, tokens} of the corpus the dashboards may read, or null
    const s = this.section();
    return this.live ? this.corpus : s.corpus;
  }
  // Each token's strongest latents: {values (T x n), latents (T x n)}.
  async tokenLatents() {
    if (!this.live) return this.section();
    return this.ask("features", { sae: FEATURES_STATE.sae });
  }
  // One latent on this prompt: {acts (T), dashboard (an entry of dashboard_data), tokens} or null when an
  // offline page does not hold it.
  async latent(latent, over) {
    if (this.live) return this.ask("latent", { sae: FEATURES_STATE.sae, latent: latent, over: over });
    const s = this.section(), i = s.shown.indexOf(latent);
    if (i < 0) return null;
    const dash = over === "corpus" && s.dashboards.corpus ? s.dashboards.corpus : s.dashboards.prompt;
    return { acts: s.acts[i], dashboard: dash[i], tokens: over === "corpus" && s.corpus ? s.corpus.tokens : this.T };
  }

  // ---- the panes ----------------------------------------------------------------------------------------
  build() {
    const root = document.getElementById("view-features");
    root.textContent = "";
    root.classList.add("features");
    const $ = (this.$ = {});
    const add = (parent, tag, cls, text, id) => {
      const e = SAE_DASHBOARD.el(tag, cls ? { class: cls } : {}, text);
      if (id) { e.id = id; $[id] = e; }
      parent.appendChild(e);
      return e;
    };
    add(root, "h2", "", "Features: the latents of a sparse autoencoder");
    add(root, "p", "note", "An SAE rewrites the activation at its hook point as a few active latents out of many. "
      + "Hover or click a token above for its strongest latents; click a latent to shade the tokens by its "
      + "activation and see its dashboard.");
    const row = add(root, "div", "features-row");
    const pick = add(row, "label", "", "SAE ");
    const sel = add(pick, "select", "", undefined, "features-sae");
    this.saes.forEach((s, i) => sel.appendChild(new Option(s.name + " \u00b7 " + s.hook + " \u00b7 " + s.d_sae
      + " latents", String(i))));
    sel.value = String(FEATURES_STATE.sae);
    this.on(sel, "change", () => {
      FEATURES_STATE.sae = Number(sel.value); FEATURES_STATE.latent = null;
      this.redraw("view");
    });
    const overLabel = add(row, "label", "", "Dashboard over ");
    const over = add(overLabel, "select", "", undefined, "features-over");
    this.on(over, "change", () => { FEATURES_STATE.over = over.value; this.redraw("view"); });
    const body = add(root, "div", "features-body");
    const left = add(body, "div", "features-token");
    add(left, "h3", "", "", "features-token-title");
    add(left, "table", "features-table", undefined, "features-table");
    add(left, "p", "status", "", "features-status").setAttribute("role", "status");
    add(body, "div", "features-latent", undefined, "features-latent");
    const steer = add(root, "div", "features-steer box");
    add(steer, "h3", "", "Steering");
    if (!this.live) {
      add(steer, "p", "note", "", "features-steer-note");
      return;
    }
    add(steer, "p", "note", "Generate after the prompt with each latent's decoder direction times its strength added "
      + "to the activation at the SAE's hook point, at every position (attnlab.interpret.steer), beside the same "
      + "generation without it (the same seed).");
    add(steer, "div", "features-steer-rows", undefined, "features-steer-rows");
    const actions = add(steer, "div", "features-row");
    const more = add(actions, "button", "", "add a latent", "features-steer-add");
    more.type = "button";
    this.on(more, "click", () => { FEATURES_STATE.steer.push({ latent: "", strength: 8 }); this.steerRows(); });
    const tokens = add(add(actions, "label", "", "new tokens "), "input", "", undefined, "features-steer-tokens");
    tokens.type = "number"; tokens.min = "1"; tokens.value = String(FEATURES_STATE.tokens);
    this.on(tokens, "input", () => { FEATURES_STATE.tokens = Number(tokens.value); });
    const temp = add(add(actions, "label", "", "temperature "), "input", "", undefined, "features-steer-temperature");
    temp.type = "number"; temp.min = "0"; temp.step = "0.1"; temp.value = String(FEATURES_STATE.temperature);
    this.on(temp, "input", () => { FEATURES_STATE.temperature = Number(temp.value); });
    const go = add(actions, "button", "", "generate steered", "features-steer-run");
    go.type = "button";
    this.on(go, "click", () => this.runSteer());
    add(steer, "p", "status", "", "features-steer-status").setAttribute("role", "status");
    add(steer, "div", "features-steer-out", undefined, "features-steer-out");
    this.steerRows();
  }

  steerRows() {
    const box = this.$["features-steer-rows"];
    box.textContent = "";
    FEATURES_STATE.steer.forEach((s, i) => {
      const row = SAE_DASHBOARD.el("div", { class: "features-row" });
      const lat = SAE_DASHBOARD.el("input", { type: "number", min: "0", "aria-label": "latent " + (i + 1),
                                              placeholder: "latent #" });
      lat.value = String(s.latent);
      lat.dataset.row = String(i);
      lat.classList.add("steer-latent");
      this.on(lat, "input", () => { s.latent = lat.value; });
      const str = SAE_DASHBOARD.el("input", { type: "number", step: "any", "aria-label": "strength " + (i + 1) });
      str.value = String(s.strength);
      str.classList.add("steer-strength");
      this.on(str, "input", () => { s.strength = str.value; });
      const drop = SAE_DASHBOARD.el("button", { type: "button" }, "remove");
      drop.disabled = FEATURES_STATE.steer.length === 1;
      this.on(drop, "click", () => { FEATURES_STATE.steer.splice(i, 1); this.steerRows(); });
      row.append("latent #", lat, " \u00d7 strength ", str, drop);
      box.appendChild(row);
    });
  }

  status(id, text, error) {
    const s = this.$[id];
    s.textContent = text;
    s.classList.toggle("error", !!error);
  }

  // ---- drawing ------------------------------------------------------------------------------------------
  async draw(what) {
    const over = this.$["features-over"], corpus = this.corpusOf();
    if (what !== "query") {
      over.textContent = "";
      over.appendChild(new Option("this prompt", "prompt"));
      if (corpus) {
        over.appendChild(new Option(corpus.name + " (" + corpus.tokens.toLocaleString() + " tokens)", "corpus"));
      }
      if (FEATURES_STATE.over === "corpus" && !corpus) FEATURES_STATE.over = "prompt";
      over.value = FEATURES_STATE.over;
      if (!this.live) this.$["features-steer-note"].textContent = this.section().steering;
    }
    const t = this.state.pinned !== null && this.state.pinned !== undefined ? this.state.pinned
      : (this.state.query !== null && this.state.query !== undefined ? this.state.query : 0);
    let tl;
    try {
      tl = await this.tokenLatents();
    } catch (err) {
      this.status("features-status", err.message, true);
      return;
    }
    this.drawToken(t, tl);
    if (what !== "query" || !this.painted) await this.drawLatent();
    else this.paint();
  }

  drawToken(t, tl) {
    const labels = this.source.data.labels || [];
    this.$["features-token-title"].textContent = "Token " + t + " (" + (labels[t] || "") + "): its strongest latents";
    const rows = [SAE_DASHBOARD.el("tr")];
    for (const h of ["latent", "activation"]) rows[0].appendChild(SAE_DASHBOARD.el("th", {}, h));
    const values = tl.values[t], latents = tl.latents[t];
    let shown = 0;
    for (let i = 0; i < values.length; i++) {
      if (!(values[i] > 0)) continue;  // fewer fired than the table holds
      const tr = SAE_DASHBOARD.el("tr", { class: "latent-row" + (latents[i] === FEATURES_STATE.latent ? " on" : "") });
      tr.dataset.latent = String(latents[i]);
      tr.dataset.value = String(values[i]);
      tr.tabIndex = 0;
      tr.appendChild(SAE_DASHBOARD.el("td", { class: "name" }, "#" + latents[i]));
      tr.appendChild(SAE_DASHBOARD.el("td", {}, values[i].toPrecision(4)));
      const choose = () => { FEATURES_STATE.latent = latents[i]; this.drawLatent(); this.drawToken(t, tl); };
      this.on(tr, "click", choose);
      this.on(tr, "keydown", (e) => { if (e.key === "Enter" || e.key === " ") choose(); });
      rows.push(tr);
      shown++;
    }
    this.$["features-table"].replaceChildren(...rows);
    this.status("features-status", shown ? "" : "No latent is active on this token.");
    document.body.dataset.featuresToken = String(t);
  }

  // The chosen latent: its activation on the tokens above, and its dashboard.
  async drawLatent() {
    const box = this.$["features-latent"], latent = FEATURES_STATE.latent, over = FEATURES_STATE.over;
    const ticket = (this.ticket = (this.ticket || 0) + 1);
    if (latent === null) {
      this.acts = null; this.painted = true; this.paint();
      box.replaceChildren(SAE_DASHBOARD.el("p", { class: "note" }, "Click a latent for its dashboard."));
      return;
    }
    if (this.live) {
      const once = over === "corpus" && !FEATURES_STATE.corpusRead[FEATURES_STATE.sae];
      const first = once ? " over the corpus (the first time, every latent: one pass over its tokens)" : "";
      box.replaceChildren(SAE_DASHBOARD.el("p", { class: "status" }, "Reading latent #" + latent + first + "\u2026"));
    }
    let d;
    try {
      d = await this.latent(latent, over);
    } catch (err) {
      if (ticket === this.ticket) box.replaceChildren(SAE_DASHBOARD.el("p", { class: "status error" }, err.message));
      return;
    }
    if (over === "corpus") FEATURES_STATE.corpusRead[FEATURES_STATE.sae] = true;
    if (ticket !== this.ticket) return;  // a newer latent was chosen meanwhile
    if (d === null) {
      this.acts = null; this.painted = true; this.paint();
      box.replaceChildren(SAE_DASHBOARD.el("p", { class: "note" }, "This page holds no dashboard of latent #" + latent
        + ": it keeps those of the " + this.section().shown.length + " strongest latents its tokens list "
        + "(attnlab.interpret.sae_view.features_section's max_latents)."));
      return;
    }
    this.acts = d.acts; this.painted = true;
    this.paint();
    const where = over === "corpus" ? "over " + d.tokens.toLocaleString() + " tokens of the corpus"
      : "over this prompt's " + d.tokens + " tokens";
    box.replaceChildren(SAE_DASHBOARD.latentView(d.dashboard, { title: "Latent #" + latent + ", " + where,
                                                                empty: "never active on these tokens" }));
    box.dataset.latent = String(latent);
    if (this.live) {  // the steering form takes the latent chosen
      const first = FEATURES_STATE.steer[0];
      if (first.latent === "" || first.latent === null) { first.latent = String(latent); this.steerRows(); }
    }
    document.body.dataset.featuresLatent = String(latent);
  }

  paint() {  // the tokens above, shaded by the chosen latent's activation
    if (!this.acts) { this.paintStrip(null); return; }
    const top = Math.max(1e-12, ...this.acts);
    this.paintStrip(this.acts, top, 1);
  }

  // ---- steering (live) ----------------------------------------------------------------------------------
  async runSteer() {
    const $ = this.$, steer = [];
    for (const s of FEATURES_STATE.steer) {
      if (s.latent === "" || s.latent === null) continue;
      steer.push({ latent: Number(s.latent), strength: Number(s.strength) });
    }
    if (!steer.length) { this.status("features-steer-status", "Choose a latent to steer with.", true); return; }
    const seedBox = document.getElementById("seed");
    const body = { sae: FEATURES_STATE.sae, steer: steer,
                   max_new_tokens: Math.max(1, Math.floor(FEATURES_STATE.tokens) || 1),
                   temperature: Math.max(0, FEATURES_STATE.temperature || 0),
                   seed: Math.max(0, Math.floor(Number(seedBox && seedBox.value) || 0)) };
    $["features-steer-run"].disabled = true;
    document.body.dataset.steering = "1";
    this.status("features-steer-status", "Generating\u2026");
    try {
      const r = await this.source.api.post("steer", Object.assign({ prompt: this.source.prompt }, body));
      const out = [];
      for (const [name, run] of [["steered", r.steered], ["unsteered", r.plain]]) {
        if (!run) continue;
        const line = SAE_DASHBOARD.el("div", { class: "features-gen" });
        line.dataset.run = name;
        line.dataset.tokens = run.tokens.join(",");
        line.appendChild(SAE_DASHBOARD.el("span", { class: "who" }, name));
        line.appendChild(SAE_DASHBOARD.el("span", { class: "prompt" }, this.source.prompt));
        line.appendChild(SAE_DASHBOARD.el("span", { class: "new" }, run.text));
        out.push(line);
      }
      $["features-steer-out"].replaceChildren(...out);
      const said = r.steering.map((s) => "#" + s.latent + " \u00d7 " + s.strength).join(", ");
      this.status("features-steer-status", "Steered with " + said + " at " + r.hook + ".");
      document.body.dataset.steered = r.steered.tokens.join(",");
      delete document.body.dataset.steerError;
    } catch (err) {
      this.status("features-steer-status", err.message, true);
      document.body.dataset.steerError = err.message;
    } finally {
      $["features-steer-run"].disabled = false;
      delete document.body.dataset.steering;
    }
  }
}
