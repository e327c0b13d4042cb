// The SAE dashboards: a list of latents and, for the chosen one, its density, activation histogram,
// promoted and suppressed tokens and top-activating contexts (tokens shaded by the latent's activation).
// SAE_DASHBOARD.latentView(L) draws one latent's dashboard (an entry of sae_view.dashboard_data's
// "latents"); the inspector's Features view (features.js) draws its dashboards with it too.
"use strict";
const SAE_DASHBOARD = (function () {
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function pct(x) { return x >= 0.001 ? (100 * x).toFixed(2) + "%" : (100 * x).toExponential(1) + "%"; }

  // Orange, stronger with the activation (relative to the latent's largest): a token's background.
  function shade(a, max) {
    const t = max > 0 ? Math.max(0, Math.min(1, a / max)) : 0;
    return t === 0 ? "transparent" : `rgba(234, 88, 12, ${(0.12 + 0.78 * t).toFixed(3)})`;
  }

  function histogram(h) {
    const w = 360, ht = 90, n = h.counts.length;
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("class", "hist");
    svg.setAttribute("width", w);
    svg.setAttribute("height", ht + 16);
    if (!n) return svg;
    const top = Math.max(...h.counts);
    h.counts.forEach((c, i) => {
      const r = document.createElementNS(svg.namespaceURI, "rect");
      const bh = top ? (c / top) * ht : 0;
      r.setAttribute("x", (i * w) / n);
      r.setAttribute("y", ht - bh);
      r.setAttribute("width", Math.max(1, w / n - 1));
      r.setAttribute("height", bh);
      const t = document.createElementNS(svg.namespaceURI, "title");
      t.textContent = `${c} tokens`;
      r.appendChild(t);
      svg.appendChild(r);
    });
    for (const [x, v, anchor] of [[0, h.lo, "start"], [w, h.hi, "end"]]) {
      const t = document.createElementNS(svg.namespaceURI, "text");
      t.setAttribute("x", x);
      t.setAttribute("y", ht + 12);
      t.setAttribute("text-anchor", anchor);
      t.textContent = v.toPrecision(2);
      svg.appendChild(t);
    }
    return svg;
  }

  function logits(rows, cls) {
    // null: the SAE writes another width than the residual stream's (a transcoder into an MLP's neurons)
    if (!rows) return el("p", {}, "none: its output is not in the residual stream");
    const table = el("table", { class: "logits" });
    for (const [tok, v] of rows) {
      const tr = el("tr");
      tr.appendChild(el("td", {}, tok));
      tr.appendChild(el("td", { class: cls }, (v >= 0 ? "+" : "") + v.toFixed(3)));
      table.appendChild(tr);
    }
    return table;
  }

  // One latent's dashboard: a fragment of its heading, its figures and its top contexts. opts.title
  // replaces the heading ("latent N"), opts.empty the line shown when it never fired.
  function latentView(L, opts) {
    opts = opts || {};
    const view = document.createDocumentFragment();
    view.appendChild(el("h2", {}, opts.title || `latent ${L.latent}`));
    const stats = el("div", { class: "box" });
    stats.appendChild(el("h3", {}, "activations"));
    stats.appendChild(el("p", {}, `density ${pct(L.density)} · max ${L.max.toPrecision(4)}`));
    stats.appendChild(histogram(L.hist));
    const up = el("div", { class: "box" });
    up.appendChild(el("h3", {}, "promotes"));
    up.appendChild(logits(L.promotes, "pos"));
    const down = el("div", { class: "box" });
    down.appendChild(el("h3", {}, "suppresses"));
    down.appendChild(logits(L.suppresses, "neg"));
    const cols = el("div", { class: "cols" });
    cols.append(stats, up, down);
    view.appendChild(cols);
    const ctx = el("div", { class: "box" });
    ctx.appendChild(el("h3", {}, "top activations"));
    if (!L.examples.length) ctx.appendChild(el("p", {}, opts.empty || "never active on these tokens"));
    for (const ex of L.examples) {
      const line = el("div", { class: "ctx" });
      line.appendChild(el("span", { class: "val" }, ex.value.toPrecision(4)));
      const mid = (ex.tokens.length - 1) / 2;
      ex.tokens.forEach((tok, i) => {
        if (tok === null) return;
        const s = el("span", { title: `activation ${ex.acts[i]}` }, tok);
        s.style.background = shade(ex.acts[i], L.max);
        if (i === mid) s.classList.add("peak");
        line.appendChild(s);
      });
      ctx.appendChild(line);
    }
    view.appendChild(ctx);
    return view;
  }

  return { el: el, pct: pct, shade: shade, latentView: latentView };
})();

// The dashboards page (sae_dashboard.html): its data embedded in the element "sae-data".
(function () {
  const node = document.getElementById("sae-data");
  if (!node) return;
  const { el, pct } = SAE_DASHBOARD;
  const data = JSON.parse(node.textContent);
  const items = document.getElementById("sae-items");
  const view = document.getElementById("sae-latent");
  const filter = document.getElementById("sae-filter");
  const sortBy = document.getElementById("sae-sort");
  document.getElementById("sae-summary").textContent =
    `${data.latents.length} of ${data.d_sae} latents at ${data.hook}, over ${data.tokens.toLocaleString()} tokens`;

  function show(L) {
    for (const li of items.children) li.classList.toggle("on", +li.dataset.latent === L.latent);
    view.replaceChildren(SAE_DASHBOARD.latentView(L));
  }

  function list() {
    const q = filter.value.trim().toLowerCase();
    const key = sortBy.value;
    const rows = data.latents.filter((L) => !q || String(L.latent) === q ||
      (L.promotes || []).some(([t]) => t.toLowerCase().includes(q)) ||
      L.examples.some((ex) => (ex.tokens[(ex.tokens.length - 1) / 2] || "").toLowerCase().includes(q)));
    rows.sort((a, b) => (key === "latent" ? a.latent - b.latent : b[key] - a[key]));
    items.replaceChildren();
    for (const L of rows) {
      const li = el("li", { "data-latent": L.latent });
      li.appendChild(el("span", {}, `#${L.latent}`));
      li.appendChild(el("small", {}, pct(L.density)));
      li.addEventListener("click", () => show(L));
      items.appendChild(li);
    }
  }

  filter.addEventListener("input", list);
  sortBy.addEventListener("change", list);
  list();
  const fromHash = data.latents.find((L) => `#${L.latent}` === location.hash);
  if (data.latents.length) show(fromHash || data.latents[0]);
})();
