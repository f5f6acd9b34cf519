// The operator page: plain DOM, no framework, no build step. Every text that comes from an item, a
// query or the service goes into the page as a text node (el() below), never as HTML.
"use strict";

(() => {
  const state = { key: null, keyRequired: false, info: null, lastQuery: null };
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";

  // Build an element; string and number children become text nodes.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "class") node.className = value;
      else if (name === "dataset") Object.assign(node.dataset, value);
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  function fmt(x, digits = 4) {
    if (x === null || x === undefined) return "-";
    if (typeof x === "number") return Number.isInteger(x) ? x.toLocaleString("en") : x.toFixed(digits);
    if (typeof x === "boolean") return x ? "yes" : "no";
    return String(x);
  }

  // A figure with a fixed number of digits (1 shows as 1.0000, as the CLI prints it), "-" when missing.
  function fixed(x, digits = 4) {
    return typeof x === "number" ? x.toFixed(digits) : "-";
  }

  function dl(rows) {
    const list = el("dl");
    for (const [label, value, field] of rows) {
      list.append(el("dt", {}, label), el("dd", field ? { dataset: { field } } : {}, value instanceof Node ? value : fmt(value)));
    }
    return list;
  }

  // -- talking to the service --------------------------------------------------------------------

  class HttpError extends Error {
    constructor(status, body) {
      super((body && body.error && body.error.message) || `HTTP ${status}`);
      this.status = status;
      this.code = body && body.error ? body.error.code : null;
    }
  }

  // A search the service sheds (503 overloaded, Retry-After) is asked again after the wait it names, as
  // any well-behaved client would: a busy box refuses a search now and then, and an operator comparing
  // columns should not see one of them fail for it.  A few tries, never more than MAX_RETRY_WAIT_S each.
  const SHED_RETRIES = 3;
  const MAX_RETRY_WAIT_S = 5;

  function retryWaitS(response, parsed) {
    if (response.status !== 503 || !parsed || !parsed.error || parsed.error.code !== "overloaded") return null;
    const seconds = Number.parseFloat(response.headers.get("retry-after"));
    return Number.isFinite(seconds) ? Math.min(Math.max(seconds, 0), MAX_RETRY_WAIT_S) : null;
  }

  async function call(path, body) {
    const headers = { accept: "application/json" };
    if (body !== undefined) headers["content-type"] = "application/json";
    if (state.key) headers.authorization = `Bearer ${state.key}`;
    for (let attempt = 0; ; attempt += 1) {
      const response = await fetch(path, {
        method: body === undefined ? "GET" : "POST",
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        credentials: "omit",
        cache: "no-store",
      });
      const parsed = await response.json().catch(() => null);
      if (response.ok) return parsed;
      const waitS = retryWaitS(response, parsed);
      if (waitS === null || attempt >= SHED_RETRIES) throw new HttpError(response.status, parsed);
      setStatus(`the service is busy: asking again in ${waitS} s`);
      await new Promise((resolve) => setTimeout(resolve, waitS * 1000));
    }
  }

  function setStatus(text, isError = false) {
    const status = $("search-status");
    status.textContent = text;
    status.classList.toggle("error", isError);
  }

  // -- views -------------------------------------------------------------------------------------

  const loaders = { search: () => {}, profile: loadProfile, health: loadHealth };

  function show(view) {
    for (const tab of document.querySelectorAll(".tab")) {
      tab.setAttribute("aria-selected", String(tab.dataset.view === view));
    }
    for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== `view-${view}`;
    document.body.dataset.view = view;
    return loaders[view]().catch((error) => fail(view, error));
  }

  function fail(view, error) {
    const target = view === "search" ? null : $(view === "profile" ? "profile-identity" : "health");
    if (target) target.replaceChildren(el("p", { class: "status error" }, error.message));
    else setStatus(error.message, true);
  }

  // -- search ------------------------------------------------------------------------------------

  function defaultModes(info) {
    // old, the profile's compatible mode (its head), and hybrid / new where a segment exists.
    const served = info.modes || [];
    const head = info.profile ? info.profile.head : null;
    return served.filter((mode) => mode === "old" || mode === head || mode === "hybrid" || mode === "new");
  }

  function renderModes(info) {
    const box = $("modes");
    const chosen = new Set(defaultModes(info));
    box.replaceChildren(el("legend", {}, "modes"));
    // compare is the head beside old: those are columns of their own here.
    for (const mode of (info.modes || []).filter((m) => m !== "compare")) {
      const input = el("input", { type: "checkbox", value: mode, checked: chosen.has(mode) });
      box.append(el("label", {}, input, ` ${mode}`));
    }
    const alphas = info.profile ? Object.keys(info.profile.alphas || {}) : [];
    $("image-field").hidden = !alphas.includes("image");
  }

  function selectedModes() {
    return [...document.querySelectorAll("#modes input:checked")].map((input) => input.value);
  }

  async function imageQuery() {
    const file = $("image").files[0];
    if (!file) return null;
    const url = await new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
    return { image_b64: String(url).split(",", 2)[1], preview: url, name: file.name };
  }

  async function search(event) {
    if (event) event.preventDefault();
    const text = $("query").value.trim();
    const image = $("image-field").hidden ? null : await imageQuery();
    const modes = selectedModes();
    const k = Number.parseInt($("k").value, 10) || 10;
    if (!text && !image) return setStatus("type a query (or choose an image)", true);
    if (!modes.length) return setStatus("choose at least one mode", true);
    const withTexts = $("with-texts").checked;
    const query = image ? { image_b64: image.image_b64 } : { text };
    performance.clearMarks();
    performance.mark("search-start");
    document.body.dataset.searching = "1";
    setStatus(`searching ${modes.join(", ")} ...`);
    try {
      const answers = await Promise.all(
        modes.map(async (mode) => {
          const started = performance.now();
          const body = await call("/v1/search", { queries: [query], k, mode, debug: true });
          return { mode, result: body.results[0], roundTripMs: performance.now() - started };
        }),
      );
      // One lookup for every column, after the slowest search. Asking for each column's items as soon as
      // its own search answered was measured slower (docs/ui.md): on one process the early lookups take
      // the CPU from the searches still running, and the slowest column still needs its own lookup.
      let found = null;
      if (withTexts) found = await call("/ui/api/items", { ids: answers.flatMap((a) => a.result.ids.concat(a.result.old_ids || [])) });
      const texts = found && found.store ? found.items : null;
      const images = texts !== null && found.modality === "image";
      renderColumns(answers, texts, k, images);
      performance.mark("search-rendered");
      const took = performance.measure("search", "search-start", "search-rendered").duration;
      document.body.dataset.renderMs = took.toFixed(2);
      const source = texts ? "item texts from the item store" : withTexts ? "ids only (no item store)" : "ids only";
      setStatus(`${modes.length} column(s), k ${k}, ${source}; ${took.toFixed(0)} ms`);
      if (images) loadThumbs(); // after the measured render: thumbnails fill in as they arrive
    } catch (error) {
      $("columns").replaceChildren();
      if (error.status === 401) {
        $("key-form").hidden = false;
        setStatus("this service needs an API key: enter it above", true);
      } else {
        setStatus(error.message, true);
      }
    } finally {
      delete document.body.dataset.searching;
      // Counts searches ended either way: what a script (the browser tests) waits on after submitting one.
      document.body.dataset.searchesEnded = String(Number(document.body.dataset.searchesEnded || 0) + 1);
    }
  }

  function overlap(a, b, k) {
    const other = new Set(b.slice(0, k));
    return a.slice(0, k).filter((id) => other.has(id)).length / k;
  }

  // Image items: each row's thumbnail from /ui/api/thumb/{id} (the operator's item store, never a path
  // from the page), fetched with the key and shown through a blob: URL, which is freed on the next search.
  let thumbUrls = [];

  async function loadThumbs() {
    for (const url of thumbUrls) URL.revokeObjectURL(url);
    thumbUrls = [];
    const cache = new Map();
    await Promise.all([...document.querySelectorAll("#columns img.thumb[data-thumb]")].map(async (img) => {
      const id = img.dataset.thumb;
      if (!cache.has(id)) cache.set(id, thumbUrl(id));
      const url = await cache.get(id);
      if (url) img.src = url;
      else img.replaceWith(el("span", { class: "thumb none", title: "no thumbnail" }, "\u2013"));
    }));
  }

  async function thumbUrl(id) {
    const response = await fetch(`/ui/api/thumb/${encodeURIComponent(id)}`, {
      headers: state.key ? { authorization: `Bearer ${state.key}` } : {},
      credentials: "omit",
    });
    if (!response.ok) return null;
    const url = URL.createObjectURL(await response.blob());
    thumbUrls.push(url);
    return url;
  }

  function renderColumns(answers, texts, k, images) {
    const lists = answers.map((a) => a.result.ids.filter((id) => id >= 0));
    const counts = new Map();
    for (const ids of lists) for (const id of new Set(ids)) counts.set(id, (counts.get(id) || 0) + 1);
    const baseline = lists[0];
    const columns = answers.map((answer, c) => {
      const r = answer.result;
      const ids = lists[c];
      const rows = ids.map((id, rank) => {
        const only = answers.length > 1 && counts.get(id) === 1;
        let move = null;
        if (c > 0) {
          const before = baseline.indexOf(id);
          // "entered", not "new": on this page "new" is the new model (a column, a mode).
          if (before < 0) move = el("span", { class: "move fresh", title: `not in ${answers[0].mode}'s top k` }, "entered");
          else if (before > rank) move = el("span", { class: "move up", title: `rank ${before + 1} in ${answers[0].mode}` }, `\u25b2${before - rank}`);
          else if (before < rank) move = el("span", { class: "move down", title: `rank ${before + 1} in ${answers[0].mode}` }, `\u25bc${rank - before}`);
        }
        const value = texts ? texts[String(id)] : undefined;
        const label = texts ? (value === null || value === undefined ? "(not in the item store)" : value) : `#${id}`;
        return el(
          "tr",
          { class: only ? "only" : null, dataset: { id: String(id) } },
          el("td", { class: "rank" }, rank + 1),
          images ? el("td", { class: "thumb" }, el("img", { class: "thumb", alt: "", dataset: { thumb: String(id) } })) : null,
          el("td", { class: "text" }, label, " ", only ? el("span", { class: "mark only" }, "only here") : null, " ", move),
          el("td", { class: "id" }, id),
          el("td", { class: "score" }, fmt(r.scores[rank], 3)),
        );
      });
      const overlaps = answers
        .map((other, j) => (j === c ? null : `${other.mode} ${overlap(ids, lists[j], k).toFixed(2)}`))
        .filter(Boolean);
      const timings = Object.entries(r.timings_ms || {}).map(([stage, ms]) => el("span", {}, `${stage} ${ms.toFixed(2)}`));
      const meta = [
        r.alpha !== null && r.alpha !== undefined ? `alpha ${fmt(r.alpha, 2)}` : null,
        r.theta !== null && r.theta !== undefined ? `residual angle ${((r.theta * 180) / Math.PI).toFixed(1)}\u00b0` : null,
        `cache ${r.cache}`,
        r.segment_hits !== undefined ? `${r.segment_hits} from the segment` : null,
        r.reranked !== undefined ? `${r.reranked} re-ranked` : null,
        r.fallback ? `fallback: ${r.fallback} alone` : null,
      ].filter(Boolean);
      return el(
        "div",
        { class: "column", dataset: { mode: answer.mode } },
        el("h3", {}, el("span", {}, answer.mode), el("span", { class: "muted" }, `${answer.roundTripMs.toFixed(0)} ms`)),
        el("div", { class: "meta" }, meta.join(" \u00b7 ")),
        el("div", { class: "meta overlap" }, `overlap@${k}: `, overlaps.join(" \u00b7 ") || "-"),
        el("div", { class: "timings" }, "stages (ms): ", timings.length ? timings : "-"),
        ids.length ? el("table", {}, el("tbody", {}, rows)) : el("p", { class: "muted" }, "no results"),
      );
    });
    $("columns").replaceChildren(...columns);
  }

  // -- profile -----------------------------------------------------------------------------------

  async function loadProfile() {
    const data = await call("/ui/api/profile");
    const p = data.profile;
    const g = data.gallery;
    const cards = [];
    if (p) {
      const models = p.models || {};
      cards.push(
        el("div", { class: "card" }, el("h3", {}, "Profile"),
          dl([
            ["id", p.id, "profile.id"],
            ["head", p.head, "profile.head"],
            ["modes", p.modes.join(", ")],
            ["fitted", p.created_at, "profile.created_at"],
            ["fit on", `${p.fit_on}, ${p.folds} folds`],
            ["alphas", Object.entries(p.alphas).map(([m, a]) => `${m} ${fmt(a, 2)}`).join(", ") || "-", "profile.alphas"],
            ["tensors sha256", p.tensors_sha256],
          ])),
        el("div", { class: "card" }, el("h3", {}, "Models"),
          dl([
            ["old", `${p.old_model_id} (dim ${p.old_dim})`, "profile.old_model"],
            ["old fingerprint", (models.old || {}).fingerprint],
            ["new", `${p.new_model_id} (dim ${p.new_dim})`, "profile.new_model"],
            ["new fingerprint", (models.new || {}).fingerprint],
          ])),
      );
    } else {
      cards.push(el("div", { class: "placeholder" }, "cut over: the new model serves alone, no profile is fitted"));
    }
    cards.push(
      el("div", { class: "card" }, el("h3", {}, "Gallery"),
        dl([
          ["fingerprint", g.fingerprint, "gallery.fingerprint"],
          ["items", g.ntotal, "gallery.ntotal"],
          ["dim / nlist", `${g.dim} / ${fmt(g.nlist)}`],
          ["built", (g.meta || {}).created_at],
          ["item store", (g.meta || {}).items ? `${fmt(g.meta.items.count)} items` : "none recorded"],
        ])),
    );
    $("profile-identity").replaceChildren(...cards);
    renderCurves(p);
    renderEval(data.eval, data.support_eval, data.notes);
    renderCompare(data.compare, data.notes);
  }

  function reportsOf(profile) {
    if (!profile) return [];
    const report = profile.fit_report || {};
    if (report.modalities) return Object.entries(report.modalities);
    return [[report.query_modality || Object.keys(profile.alphas)[0] || "text", report]];
  }

  function renderCurves(profile) {
    const box = $("profile-curves");
    const panels = reportsOf(profile)
      .filter(([, report]) => report.support_recall)
      .map(([modality, report]) => curvePanel(modality, report, profile.alphas[modality]));
    box.replaceChildren(...(panels.length ? panels : [el("div", { class: "placeholder" }, "this profile's fit report has no support curve (its head weighs nothing per modality)")]));
  }

  // The score the report's criterion ranked alpha by, and its standard error (render.py's _SCORE_OF / _SE_OF).
  const SCORES = { r1: ["recall@1", "se@1"], mean: ["mean@1-10", "se_mean@1-10"], mrr: ["mrr@10", "se_mrr@10"] };

  function scoreOf(report) {
    const [key, seKey] = SCORES[String(report.criterion || "r1").replace(/-1se$/, "")] || SCORES.r1;
    const rows = Object.values(report.support_recall)[0] || [];
    return rows.length && key in rows[0] ? [key, seKey] : SCORES.r1; // reports older than criteria: R@1
  }

  // The criterion's support score against alpha for every curve of one selection report, with +-1 s.e. bars,
  // the band within one s.e. of the first curve's best point, old->old (alpha 0) dashed, the chosen alpha dotted.
  function curvePanel(modality, report, alpha) {
    const W = 640, H = 300, L = 62, R = 14, T = 16, B = 40;
    const [key, seKey] = scoreOf(report);
    const curves = Object.entries(report.support_recall);
    const points = curves.flatMap(([, rows]) => rows.flatMap((r) => [r[key] - (r[seKey] || 0), r[key] + (r[seKey] || 0)]));
    let lo = Math.min(...points), hi = Math.max(...points);
    const pad = (hi - lo) * 0.08 || 0.01;
    lo -= pad; hi += pad;
    const x = (a) => L + a * (W - L - R);
    const y = (v) => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
    const chart = svg("svg", { class: "curve", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `support ${key} against alpha, ${modality} queries` });
    for (let i = 0; i <= 4; i++) {
      const v = lo + ((hi - lo) * i) / 4;
      chart.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v) }));
      chart.append(svg("text", { x: L - 4, y: y(v) + 4, "text-anchor": "end" }, v.toFixed(3)));
    }
    for (let a = 0; a <= 1.0001; a += 0.2) {
      chart.append(svg("text", { x: x(a), y: H - B + 16, "text-anchor": "middle" }, a.toFixed(1)));
    }
    chart.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
    chart.append(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
    chart.append(svg("text", { x: 12, y: (T + H - B) / 2, transform: `rotate(-90 12 ${(T + H - B) / 2})`, "text-anchor": "middle" }, `support ${key}, \u00b1 1 s.e.`));
    chart.append(svg("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle" }, "alpha (0 = old query, 1 = mapped new query)"));
    const colours = ["#2457a6", "#c75b12", "#1b7a3d", "#7b3fa0"];
    curves.forEach(([mode, rows], i) => {
      const colour = colours[i % colours.length];
      if (i === 0) {
        const best = rows.reduce((m, r) => (r[key] > m[key] ? r : m), rows[0]);
        const se = best[seKey] || 0;
        if (se > 0) chart.append(svg("rect", { class: "band", x: L, width: W - L - R, y: y(best[key]), height: y(best[key] - se) - y(best[key]) }));
        const zero = rows.find((r) => r.alpha === 0);
        if (zero) chart.append(svg("line", { class: "baseline", x1: L, x2: W - R, y1: y(zero[key]), y2: y(zero[key]) }));
      }
      const path = rows.map((r, j) => `${j ? "L" : "M"}${x(r.alpha).toFixed(1)},${y(r[key]).toFixed(1)}`).join(" ");
      chart.append(svg("path", { d: path, fill: "none", stroke: colour, "stroke-width": 2 }));
      for (const r of rows) {
        const se = r[seKey] || 0;
        if (se > 0) chart.append(svg("line", { x1: x(r.alpha), x2: x(r.alpha), y1: y(r[key] - se), y2: y(r[key] + se), stroke: colour }));
        chart.append(svg("circle", { cx: x(r.alpha), cy: y(r[key]), r: 3, fill: colour }));
      }
      const chosen = (report.chosen || {})[mode];
      if (chosen) chart.append(svg("line", { class: "chosen", x1: x(chosen.alpha), x2: x(chosen.alpha), y1: T, y2: H - B, stroke: colour }));
      chart.append(svg("text", { x: W - R - 4, y: T + 12 + 14 * i, "text-anchor": "end", fill: colour }, `${mode}${chosen ? ` (chosen ${chosen.alpha.toFixed(1)})` : ""}`));
    });
    const lines = [
      `served alpha ${fmt(alpha, 2)}; support ${fmt(report.support_queries)} queries, ${report.selection || ""}`,
      report.criterion_text,
      report.best_head ? `best head ${report.best_head.head}: ${report.best_head.why}` : null,
      report.residual_angle_deg ? `residual angle (degrees): ${Object.entries(report.residual_angle_deg).map(([k, v]) => `${k} ${fmt(v, 1)}`).join(", ")}` : null,
    ].filter(Boolean);
    return el("div", { class: "card", dataset: { modality } }, el("h3", {}, `${modality} queries`), chart, ...lines.map((l) => el("p", { class: "muted" }, l)));
  }

  // A difference from a reference in points with its 95 % interval, as `eval` prints it: "+1.2 [-1.8, +4.2]".
  function points(d) {
    if (!d) return "-";
    const p = (x) => `${x >= 0 ? "+" : ""}${(100 * x).toFixed(1)}`;
    return `${p(d.diff)} [${p(d.low)}, ${p(d.high)}]`;
  }

  function verdictCell(verdict) {
    if (!verdict) return el("td", {}, "-");
    const kind = verdict === "compatible" ? "ok" : verdict === "not compatible" ? "bad" : "muted";
    return el("td", {}, el("span", { class: kind }, verdict));
  }

  function table(className, headers, rows) {
    return el("table", { class: className },
      el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
      el("tbody", {}, rows));
  }

  // The eval table: the columns `nobackfill eval` prints, from the rows it saved (--json-out).
  function evalTable(rows) {
    const judged = (rows.find((r) => r.judged_on) || {}).judged_on || "recall@10";
    const short = (m) => m.replace("recall", "R");
    const arr = (r) => {
      const part = (r.retention || {})["arr@10"];
      return part ? `${part.value.toFixed(3)} [${part.low.toFixed(3)}, ${part.high.toFixed(3)}]` : "-";
    };
    const headers = ["method", "alpha", "R@1", "R@5", "R@10", "MRR@10", "nDCG@10", "R@1 vs old (pt) [95 %]",
      "R@10 vs old (pt) [95 %]", `compatible (${short(judged)})`, "compatible (R@1)", "ARR@10 [95 %]", "pfr", "nfr"];
    const body = rows.map((r) => el("tr", { dataset: { method: String(r.method) } },
      el("td", {}, r.method), el("td", {}, fixed(r.alpha, 2)),
      ["recall@1", "recall@5", "recall@10", "mrr@10", "ndcg@10"].map((m) => el("td", {}, fixed(r[m]))),
      el("td", {}, points((r.vs_old || {})["recall@1"])), el("td", {}, points((r.vs_old || {})["recall@10"])),
      verdictCell(r.compatible), verdictCell(r["compatible@1"]),
      el("td", {}, arr(r)), el("td", {}, fixed(r.pfr)), el("td", {}, fixed(r.nfr))));
    return table("eval", headers, body);
  }

  function notesOf(notes) {
    return (notes || []).map((note) => el("p", { class: "status error" }, note));
  }

  function renderEval(saved, supportRows, notes) {
    const box = $("profile-eval");
    if (saved) {
      box.replaceChildren(
        el("p", { class: "muted" }, `profile ${saved.profile_id} (${saved.head}) on ${saved.test}, ${saved.modality} queries; `,
          `saved ${saved.created_at}. Differences from old->old in points with 95 % paired bootstrap intervals; `,
          "compatible: the interval is above 0 (below: not compatible; across: not distinguishable); ",
          "ARR@10 = R@10 / new->new's; pfr / nfr: flips against old->old at R@1."),
        evalTable(saved.rows));
      return;
    }
    const how = el("div", { class: "placeholder" },
      "No saved evaluation of this profile. Score it on a held-out test folder with ",
      el("code", {}, "nobackfill eval PROFILE_DIR TEST_DIR --json-out EVAL.json"),
      " and serve with NOBACKFILL_API__UI_EVAL=EVAL.json.");
    if (Array.isArray(supportRows) && supportRows.length) {
      box.replaceChildren(...notesOf(notes), el("p", { class: "muted" }, "on the support logits (from the fit report):"), evalTable(supportRows), how);
    } else {
      box.replaceChildren(...notesOf(notes), how);
    }
  }

  const OUTCOMES = {
    pass: ["PASS", "ok", "the candidate is compatible and not worse than the current profile beyond the noise"],
    fail: ["FAIL", "bad", "the candidate must not replace the current profile"],
    undecided: ["NOT ENOUGH DATA", "muted", "neither better nor worse can be told on this test set"],
    refused: ["REFUSED", "bad", "the two profiles cannot be compared"],
  };

  function renderCompare(verdict, notes) {
    const box = $("profile-compare");
    if (!verdict) {
      box.replaceChildren(...notesOf(notes), el("div", { class: "placeholder" },
        "No candidate profile is being compared. The rollout gate is ",
        el("code", {}, "nobackfill profile compare CURRENT_DIR CANDIDATE_DIR TEST_DIR --json-out COMPARE.json"),
        " (exit 0: safe to ship); serve with NOBACKFILL_API__UI_COMPARE=COMPARE.json to show its verdict here."));
      return;
    }
    const [label, kind, meaning] = OUTCOMES[verdict.outcome] || [verdict.outcome, "muted", ""];
    const parts = [
      el("p", { class: "verdict", dataset: { outcome: verdict.outcome } }, el("strong", { class: kind }, label), ` ${meaning}`),
      el("p", { class: "muted" }, `candidate ${verdict.candidate_profile_id} against the served ${verdict.profile_id}, `,
        `on ${verdict.test} (${fmt(verdict.queries)} ${verdict.modality} queries); saved ${verdict.created_at}`),
    ];
    if (verdict.reasons && verdict.reasons.length) parts.push(el("ul", { class: "reasons" }, verdict.reasons.map((r) => el("li", {}, r))));
    if (verdict.current) {
      const judged = verdict.judged_on;
      const headers = ["profile", "head", "alpha", "R@1", "R@5", "R@10", `vs old ${judged.replace("recall", "R")} (pt)`,
        "vs old R@1 (pt)", "compatible", "compatible (R@1)", "pfr", "nfr"];
      const old = verdict.old;
      const rows = [el("tr", {}, el("td", {}, "old->old"), el("td", {}, "old"), el("td", {}, fixed(0, 2)),
        ["recall@1", "recall@5", "recall@10"].map((m) => el("td", {}, fixed(old[m]))), Array(6).fill(0).map(() => el("td", {}, "-")))];
      for (const name of ["current", "candidate"]) {
        const p = verdict[name];
        rows.push(el("tr", { dataset: { profile: name } },
          el("td", {}, `${name} ${p.profile_id.slice(0, 12)}`), el("td", {}, p.head), el("td", {}, fixed(p.alpha, 2)),
          ["recall@1", "recall@5", "recall@10"].map((m) => el("td", {}, fixed(p[m]))),
          el("td", {}, points(p.vs_old[judged])), el("td", {}, points(p.vs_old["recall@1"])),
          verdictCell(p.compatible), verdictCell(p["compatible@1"]), el("td", {}, fixed(p.pfr)), el("td", {}, fixed(p.nfr))));
      }
      parts.push(table("eval compare", headers, rows));
      const d = verdict.difference;
      parts.push(el("p", { class: "figures" },
        `candidate - current: R@1 ${d["recall@1"] >= 0 ? "+" : ""}${d["recall@1"].toFixed(4)} (paired s.e. ${d["se@1"].toFixed(4)}); `,
        `it fixes ${d.fixed} and breaks ${d.broken} queries at R@1 (sign test P = ${d.p_worse.toPrecision(2)}, worse below ${verdict.p_worse}); `,
        `it breaks ${(100 * d.nfr_vs_current).toFixed(1)} % of the queries (at most ${(100 * verdict.max_nfr).toFixed(0)} %)`));
    }
    if (verdict.traffic) {
      const t = verdict.traffic;
      parts.push(el("p", { class: "muted" }, `traffic shadow (${fmt(t.pairs)} queries over ${t.gallery}): overlap@10 ${fmt(t["overlap@10"], 3)} (p5 ${fmt(t["overlap@10_p5"], 2)})`));
    }
    box.replaceChildren(...notesOf(notes), ...parts);
  }

  // -- health ------------------------------------------------------------------------------------

  let healthTimer = null;

  async function loadHealth() {
    const [info, health] = await Promise.all([call("/v1/info"), call("/ui/api/health")]);
    state.info = info;
    const ready = health.status === "ready";
    const recent = health.recent;
    const cards = [
      el("div", { class: "card" }, el("h3", {}, "Readiness"),
        dl([
          ["status", el("span", { class: ready ? "ok" : "bad" }, health.status), "health.status"],
          ["why", health.problems.length ? health.problems.join("; ") : "every part serves"],
          ["alive", health.alive],
          ["queries in flight", health.in_flight],
        ])),
      el("div", { class: "card" }, el("h3", {}, `Searches, last ${fmt(recent.window_s, 0)} s`),
        dl([
          ["requests/s", fmt(recent.requests_per_s, 2), "recent.requests_per_s"],
          ["p50", recent.p50_ms === null ? "-" : `${fmt(recent.p50_ms, 1)} ms`, "recent.p50_ms"],
          ["p99", recent.p99_ms === null ? "-" : `${fmt(recent.p99_ms, 1)} ms`, "recent.p99_ms"],
          ["requests", recent.requests, "recent.requests"],
        ]),
        el("p", { class: "muted" }, "from this process's own counters (no Prometheus); the window is the time since an earlier look, at most 5 minutes")),
      el("div", { class: "card" }, el("h3", {}, "Cache"),
        dl([
          ["kind", info.cache.kind, "cache.kind"],
          ["state", info.cache.state, "cache.state"],
          ["breaker", el("span", { class: health.cache.breaker_open ? "bad" : "ok" }, health.cache.breaker_open ? "open (skipping Redis)" : "closed"), "cache.breaker"],
          ["hit ratio (window)", recent.cache_hit_ratio === null ? "-" : fmt(recent.cache_hit_ratio, 3), "recent.cache_hit_ratio"],
          ["hit ratio (since start)", health.cache.hit_ratio_since_start === null ? "-" : fmt(health.cache.hit_ratio_since_start, 3)],
        ])),
      el("div", { class: "card" }, el("h3", {}, "Served"),
        dl([
          ["profile", info.profile ? `${info.profile.id} (${info.profile.head})` : "none (cut over)", "profile.id"],
          ["default mode", info.default_mode, "default_mode"],
          ["modes", info.modes.join(", "), "modes"],
          ["gallery", info.gallery.fingerprint, "gallery.fingerprint"],
          ["gallery items", info.gallery.ntotal, "gallery.ntotal"],
          ["nprobe", info.gallery.nprobe_default ?? "- (no IVF lists)", "gallery.nprobe_default"],
          ["item store", info.items ? `${fmt(info.items.count)} items` : "none (ids only)", "items.count"],
        ])),
    ];
    for (const [role, e] of Object.entries(health.encoders)) {
      const failures = Object.entries(e.failures).filter(([, n]) => n > 0).map(([reason, n]) => `${reason} ${n}`).join(", ");
      cards.push(el("div", { class: "card", dataset: { encoder: role } }, el("h3", {}, `${role} encoder`),
        dl([
          ["model", e.id, `${role}_model.id`],
          ["backend / device", `${e.backend || "-"} / ${e.device}`],
          ["dim", e.dim, `${role}_model.dim`],
          ["copies / isolation", `${e.replicas} / ${e.isolation}`],
          ["problem", e.problem || "none"],
          ["restarts", `${e.process_restarts} process, ${e.batcher_restarts} batcher`, `${role}.restarts`],
          ["failed batches", failures || "none"],
        ])));
    }
    const seg = info.segment;
    cards.push(seg
      ? el("div", { class: "card" }, el("h3", {}, "Backfill"),
          dl([
            ["coverage", `${(seg.coverage * 100).toFixed(2)} %`, "segment.coverage"],
            ["moved", `${fmt(seg.moved)} of ${fmt(seg.gallery_items)}`, "segment.moved"],
            ["shards", seg.shards, "segment.shards"],
            ["merge", seg.merge],
            ["cascade", info.cascade ? `${info.cascade.candidates} candidates, ${info.cascade.pending_rows} rows pending` : "off"],
          ]))
      : el("div", { class: "placeholder" }, "No new-model segment: nothing backfilled yet (NOBACKFILL_INDEX__SEGMENT_DIR; docs/backfill.md)."));
    $("health").replaceChildren(...cards);
    $("health-stamp").textContent = `as of ${new Date().toLocaleTimeString()}`;
    clearTimeout(healthTimer);
    healthTimer = setTimeout(() => { if (document.body.dataset.view === "health") loadHealth().catch((e) => fail("health", e)); }, 5000);
  }

  // -- start -------------------------------------------------------------------------------------

  async function start() {
    for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => show(tab.dataset.view));
    $("search-form").addEventListener("submit", search);
    $("health-refresh").addEventListener("click", () => loadHealth().catch((e) => fail("health", e)));
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      state.key = $("api-key").value || null; // this closure is the only place it is kept
      $("api-key").value = "";
      setStatus(state.key ? "key set for this tab" : "key cleared");
      $("query").focus();
    });
    const [config, info] = await Promise.all([call("/ui/api/config"), call("/v1/info")]);
    state.keyRequired = config.api_key_required;
    state.info = info;
    $("key-form").hidden = !state.keyRequired;
    renderModes(info);
    const models = `${info.old_model.id || info.old_model.backend} \u2192 ${info.new_model.id}`;
    $("identity").textContent = `${models} \u00b7 profile ${info.profile ? info.profile.id : "none"} \u00b7 ${fmt(info.gallery.ntotal)} items`;
    document.body.dataset.ready = "1";
    performance.mark("first-render");
  }

  start().catch((error) => setStatus(`cannot reach the service: ${error.message}`, true));
})();
