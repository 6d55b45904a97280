// rljax run report: renders the inline JSON of #report-data (no network, no libraries).
"use strict";
(function () {
  var statusEl = document.getElementById("status");
  function fail(msg) {
    statusEl.dataset.state = "error";
    statusEl.textContent = "error: " + msg;
    document.title = "rljax report: error";
  }
  window.addEventListener("error", function (e) { fail(e.message || String(e)); });

  var DATA = JSON.parse(document.getElementById("report-data").textContent);
  var PLOT_KEYS = ["reward/mean", "reward/std", "correct_fraction", "eval/reward_mean", "loss", "grad_norm",
    "entropy", "advantage/abs_mean", "rl/clip_frac", "turns/mean", "rollout/response_tokens",
    "rollout/end_length_fraction", "filters/masked_steps", "merge/samples_per_trajectory", "policy_version/lag",
    "time/step_s"];
  var state = { step: null, color: "logprob", show: "all", sort: "id" };
  var steps = Object.keys(DATA.steps).map(Number).sort(function (a, b) { return a - b; });
  if (steps.length) state.step = steps[steps.length - 1];
  // the view can be named in the URL: report.html#step=2&color=advantage&show=filtered&sort=reward
  location.hash.replace(/^#/, "").split("&").forEach(function (kv) {
    var p = kv.split("="), k = p[0], v = decodeURIComponent(p[1] || "");
    if (k === "step" && steps.indexOf(Number(v)) >= 0) state.step = Number(v);
    else if (k === "color" && ["logprob", "advantage", "mask"].indexOf(v) >= 0) state.color = v;
    else if (k === "show" && ["all", "trained", "filtered", "errored", "dropped"].indexOf(v) >= 0) state.show = v;
    else if (k === "sort" && ["id", "reward"].indexOf(v) >= 0) state.sort = v;
  });

  function el(tag, attrs, children) {
    var e = document.createElement(tag);
    if (attrs) for (var k in attrs) {
      if (k === "text") e.textContent = attrs[k];
      else if (k === "cls") e.className = attrs[k];
      else if (k.slice(0, 2) === "on") e.addEventListener(k.slice(2), attrs[k]);
      else e.setAttribute(k, attrs[k]);
    }
    (children || []).forEach(function (c) { if (c != null) e.appendChild(typeof c === "string" ? document.createTextNode(c) : c); });
    return e;
  }
  var SVG = "http://www.w3.org/2000/svg";
  function svg(tag, attrs) {
    var e = document.createElementNS(SVG, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    return e;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "-";
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v)) return String(v);
    var a = Math.abs(v);
    return (a !== 0 && (a < 1e-3 || a >= 1e5)) ? v.toExponential(2) : v.toPrecision(4).replace(/\.?0+$/, "");
  }

  function short(v) {  // an axis label: 3 significant digits
    var a = Math.abs(v);
    return (a !== 0 && (a < 1e-2 || a >= 1e4)) ? v.toExponential(1) : String(Number(v.toPrecision(3)));
  }

  // ---- metric plots ---------------------------------------------------------------------------
  function series(key) {
    var by = {};
    DATA.metrics.forEach(function (r) { if (typeof r[key] === "number" && typeof r.step === "number") by[r.step] = r[key]; });
    return Object.keys(by).map(Number).sort(function (a, b) { return a - b; }).map(function (s) { return [s, by[s]]; });
  }
  function plot(key) {
    var pts = series(key), W = 220, H = 70, L = 40, R = 4, T = 6, B = 14;
    var box = el("div", { cls: "plot", "data-key": key });
    var last = pts.length ? pts[pts.length - 1][1] : null;
    box.appendChild(el("div", { cls: "t" }, [el("span", { text: key, title: key }), el("span", { text: "last " + fmt(last) })]));
    var s = svg("svg", { viewBox: "0 0 " + W + " " + H, preserveAspectRatio: "none" });
    if (!pts.length) { box.appendChild(el("div", { cls: "empty", text: "no data" })); return box; }
    var xs = pts.map(function (p) { return p[0]; }), ys = pts.map(function (p) { return p[1]; });
    var x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs), y0 = Math.min.apply(null, ys), y1 = Math.max.apply(null, ys);
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) { var d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
    function X(x) { return L + (x - x0) / (x1 - x0) * (W - L - R); }
    function Y(y) { return T + (1 - (y - y0) / (y1 - y0)) * (H - T - B); }
    s.appendChild(svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#ccd" }));
    s.appendChild(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#ccd" }));
    [[y1, Y(y1) + 7], [y0, Y(y0)]].forEach(function (t) { var e = svg("text", { x: L - 3, y: t[1], "text-anchor": "end" }); e.textContent = short(t[0]); s.appendChild(e); });
    [[x0, L, "start"], [x1, W - R, "end"]].forEach(function (t) { var e = svg("text", { x: t[1], y: H - 2, "text-anchor": t[2] }); e.textContent = "step " + fmt(t[0]); s.appendChild(e); });
    s.appendChild(svg("polyline", { points: pts.map(function (p) { return X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1); }).join(" ") }));
    if (pts.length <= 60) pts.forEach(function (p) {
      var c = svg("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2 });
      var t = svg("title", {}); t.textContent = "step " + p[0] + ": " + fmt(p[1]); c.appendChild(t); s.appendChild(c);
    });
    box.appendChild(s);
    return box;
  }
  function metricKeys() {
    var keys = {};
    DATA.metrics.forEach(function (r) { for (var k in r) if (k !== "step" && k !== "time" && typeof r[k] === "number") keys[k] = 1; });
    return Object.keys(keys).sort();
  }

  // ---- token colours ----------------------------------------------------------------------------
  function advScale(records) {
    var m = 0;
    records.forEach(function (r) { (r.advantages || []).forEach(function (a) { if (a !== null) m = Math.max(m, Math.abs(a)); }); });
    return m || 1;
  }
  function colour(mode, lp, adv, mask, scale) {
    if (mode === "logprob") {
      if (lp === null || lp === undefined) return "#eee";
      var p = Math.exp(lp);  // 0 (red) .. 1 (green)
      return "hsl(" + Math.round(120 * p) + ", 75%, " + Math.round(80 - 8 * p) + "%)";
    }
    if (mode === "advantage") {
      if (adv === null || adv === undefined) return "#eee";
      var a = Math.max(-1, Math.min(1, adv / scale));
      return a >= 0 ? "hsl(130, 60%, " + Math.round(96 - 30 * a) + "%)" : "hsl(0, 75%, " + Math.round(96 + 30 * a) + "%)";
    }
    return mask ? "#bfe8c6" : "#dcdcdc";
  }
  function shown(text) {
    return text.replace(/\n/g, "\u21b5\n").replace(/\t/g, "\u21e5\t").replace(/[\u0000-\u0008\u000b-\u001f\u007f]/g, "\u00b7");
  }

  // ---- rollouts -----------------------------------------------------------------------------------
  var SAMPLE_COLOURS = ["#3461c1", "#c1343f", "#2e8b57", "#b5651d", "#7b3fb5", "#1b9aaa", "#c0a000", "#d0508f"];
  function groupByTrajectory(records) {
    var order = [], by = {};
    records.forEach(function (r) { if (!by[r.trajectory_id]) { by[r.trajectory_id] = []; order.push(r.trajectory_id); } by[r.trajectory_id].push(r); });
    return order.map(function (id) { return { id: id, calls: by[id].sort(function (a, b) { return a.turn - b.turn; }) }; });
  }
  function messagesOf(call, prev) {
    var msgs = call.messages || [];
    // the messages new since the previous turn (its conversation + reply), the whole one for turn 0
    var start = prev && prev.messages ? Math.min(prev.messages.length + 1, msgs.length) : 0;
    var box = el("div", { cls: "msgs" });
    function msgEl(m) {
      var content = m.content;
      if (typeof content !== "string") content = JSON.stringify(content);
      if (m.tool_calls) content += " " + JSON.stringify(m.tool_calls);
      return el("div", { cls: "msg" }, [el("span", { cls: "role", text: m.role }), content || ""]);
    }
    if (start > 0) {
      var d = el("details", { cls: "conv" }, [el("summary", { text: "earlier conversation (" + start + " messages)" })]);
      msgs.slice(0, start).forEach(function (m) { d.appendChild(msgEl(m)); });
      box.appendChild(d);
    }
    msgs.slice(start).forEach(function (m) { box.appendChild(msgEl(m)); });
    return box;
  }
  function trajectoryCard(t, scale, counts) {
    var last = t.calls[t.calls.length - 1];
    var samples = [], sampleIndex = {};
    t.calls.forEach(function (c) { if (c.sample !== null && !(c.sample in sampleIndex)) { sampleIndex[c.sample] = samples.length; samples.push(c.sample); } });
    var head = el("div", { cls: "h" }, [
      el("span", { cls: "id", text: t.id }),
      el("span", { cls: "badge s-" + last.status, text: last.status }),
      el("span", { cls: "reward", text: "reward " + fmt(last.trajectory_reward) }),
      el("span", { cls: "muted", text: last.env + " \u00b7 " + t.calls.length + " turn" + (t.calls.length > 1 ? "s" : "") +
        " \u00b7 end " + last.end + " \u00b7 " + samples.length + " sample" + (samples.length === 1 ? "" : "s") }),
    ]);
    var card = el("div", { cls: "traj", "data-trajectory": t.id, "data-status": last.status }, [head]);
    head.addEventListener("click", function () { card.classList.toggle("closed"); });
    var turns = el("div", { cls: "turns" });
    t.calls.forEach(function (c, i) {
      var prev = i > 0 ? t.calls[i - 1] : null;
      var si = c.sample === null ? -1 : sampleIndex[c.sample];
      var col = si < 0 ? "#bbb" : SAMPLE_COLOURS[si % SAMPLE_COLOURS.length];
      var isNew = si >= 0 && (!prev || prev.sample !== c.sample);
      var side = el("div", { cls: "side" }, [
        el("div", { text: "turn " + c.turn }),
        el("div", { cls: "sample", text: c.sample === null ? "not trained" : "sample " + c.sample }),
        isNew && prev ? el("div", { cls: "new", text: "new sample" }) : null,
        el("div", { text: c.completion_ids.length + " tok \u00b7 v" + c.weight_version }),
        el("div", { text: "stop " + c.stop_reason }),
      ]);
      side.style.borderLeftColor = col;
      var comp = el("div", { cls: "comp" });
      c.tokens.forEach(function (tok, k) {
        var lp = c.logprobs[k], adv = c.advantages.length ? c.advantages[k] : null, mask = c.loss_mask[k];
        var span = el("span", { cls: "tok", title: "id " + c.completion_ids[k] + "  logprob " + fmt(lp) + "  p " +
          fmt(lp === null ? null : Math.exp(lp)) + "  adv " + fmt(adv) + "  mask " + mask, text: shown(tok) });
        span.style.background = colour(state.color, lp, adv, mask, scale);
        comp.appendChild(span);
        counts.tokens += 1;
      });
      var body = el("div", { cls: "body" }, [messagesOf(c, prev), comp,
        el("div", { cls: "meta", text: "prompt " + c.prompt_len + " tok \u00b7 reward " + fmt(c.reward) +
          (c.advantage !== null ? " \u00b7 mean advantage " + fmt(c.advantage) : "") })]);
      turns.appendChild(el("div", { cls: "turn", "data-turn": c.turn }, [side, body]));
      counts.calls += 1;
    });
    card.appendChild(turns);
    return card;
  }

  function segmented(options, current, onPick) {
    var seg = el("span", { cls: "seg" });
    options.forEach(function (o) {
      seg.appendChild(el("button", { cls: o[0] === current ? "on" : "", "data-value": o[0], text: o[1], onclick: function () { onPick(o[0]); } }));
    });
    return seg;
  }

  var rolloutsBox = el("div", { id: "rollouts" });
  function renderRollouts() {
    rolloutsBox.textContent = "";
    if (state.step === null) {
      rolloutsBox.appendChild(el("div", { cls: "empty", text: "No saved rollouts: train with config.trainer.save_rollouts_every=N." }));
      return { calls: 0, tokens: 0, trajectories: 0 };
    }
    var records = DATA.steps[String(state.step)] || [];
    var scale = advScale(records);
    var trajs = groupByTrajectory(records);
    var byStatus = {};
    trajs.forEach(function (t) { var s = t.calls[t.calls.length - 1].status; byStatus[s] = (byStatus[s] || 0) + 1; });
    var rewards = trajs.map(function (t) { return t.calls[t.calls.length - 1].trajectory_reward; }).filter(function (x) { return x !== null; });
    var mean = rewards.length ? rewards.reduce(function (a, b) { return a + b; }, 0) / rewards.length : null;
    if (state.show !== "all") trajs = trajs.filter(function (t) { return t.calls[t.calls.length - 1].status === state.show; });
    if (state.sort === "reward") trajs.sort(function (a, b) { return (b.calls[b.calls.length - 1].trajectory_reward || 0) - (a.calls[a.calls.length - 1].trajectory_reward || 0); });
    var controls = el("div", { cls: "controls" }, [
      el("label", { text: "step" }),
      (function () {
        var s = el("select", { id: "step-select", onchange: function (e) { state.step = Number(e.target.value); render(); } });
        steps.forEach(function (st) { var o = el("option", { value: st, text: String(st) }); if (st === state.step) o.selected = true; s.appendChild(o); });
        return s;
      })(),
      el("label", { text: "colour" }),
      segmented([["logprob", "logprob"], ["advantage", "advantage"], ["mask", "loss mask"]], state.color, function (v) { state.color = v; render(); }),
      el("span", { cls: "legend" }, [el("span", { text: state.color === "mask" ? "masked" : state.color === "advantage" ? "\u2212" + fmt(scale) : "p=0" }),
        (function () { var i = el("i"); i.style.background = state.color === "logprob" ? "linear-gradient(90deg," + colour("logprob", Math.log(1e-9)) + "," + colour("logprob", Math.log(0.5)) + "," + colour("logprob", 0) + ")" :
          state.color === "advantage" ? "linear-gradient(90deg," + colour("advantage", null, -1, 0, 1) + ",#fff," + colour("advantage", null, 1, 0, 1) + ")" :
          "linear-gradient(90deg,#dcdcdc 50%,#bfe8c6 50%)"; return i; })(),
        el("span", { text: state.color === "mask" ? "trained" : state.color === "advantage" ? "+" + fmt(scale) : "p=1" })]),
      el("label", { text: "show" }),
      segmented([["all", "all"], ["trained", "trained"], ["filtered", "filtered"], ["errored", "errored"], ["dropped", "dropped"]], state.show, function (v) { state.show = v; render(); }),
      el("label", { text: "sort" }),
      segmented([["id", "task"], ["reward", "reward"]], state.sort, function (v) { state.sort = v; render(); }),
    ]);
    rolloutsBox.appendChild(controls);
    var parts = Object.keys(byStatus).sort().map(function (s) { return byStatus[s] + " " + s; }).join(", ");
    rolloutsBox.appendChild(el("div", { cls: "summary", text: "step " + state.step + ": " + groupByTrajectory(records).length +
      " trajectories (" + parts + "), " + records.length + " calls, mean reward " + fmt(mean) + ". Click a header to fold it." }));
    var counts = { calls: 0, tokens: 0, trajectories: trajs.length };
    trajs.forEach(function (t) { rolloutsBox.appendChild(trajectoryCard(t, scale, counts)); });
    if (!trajs.length) rolloutsBox.appendChild(el("div", { cls: "empty", text: "no trajectories with status " + state.show }));
    return counts;
  }

  var app = document.getElementById("app");
  var lastRow = DATA.metrics.length ? DATA.metrics[DATA.metrics.length - 1] : {};
  app.appendChild(el("header", {}, [el("h1", { text: "rljax \u00b7 " + DATA.name }),
    el("span", { cls: "kv" }, ["steps ", el("b", { text: String(lastRow.step === undefined ? 0 : lastRow.step) })]),
    el("span", { cls: "kv" }, ["reward/mean ", el("b", { text: fmt(lastRow["reward/mean"]) })]),
    el("span", { cls: "kv" }, ["saved rollout steps ", el("b", { text: steps.length ? steps.join(", ") : "none" })]),
    el("span", { cls: "kv", text: DATA.workdir })]));
  var main = el("main");
  app.appendChild(main);
  main.appendChild(el("h2", { text: "Metrics" }));
  var plots = el("div", { cls: "plots", id: "plots" });
  var keys = metricKeys();
  PLOT_KEYS.filter(function (k) { return keys.indexOf(k) >= 0; }).forEach(function (k) { plots.appendChild(plot(k)); });
  var extra = el("select", { id: "metric-select", onchange: function (e) { if (e.target.value) plots.appendChild(plot(e.target.value)); } },
    [el("option", { value: "", text: "add a plot\u2026" })]);
  keys.forEach(function (k) { extra.appendChild(el("option", { value: k, text: k })); });
  main.appendChild(el("div", { cls: "summary" }, [extra, " " + keys.length + " metrics in metrics.jsonl, " + DATA.metrics.length + " rows"]));
  main.appendChild(plots);
  main.appendChild(el("h2", { text: "Rollouts" }));
  main.appendChild(rolloutsBox);

  function render() {
    var c = renderRollouts();
    statusEl.dataset.state = "ok";
    statusEl.dataset.step = state.step === null ? "" : String(state.step);
    statusEl.dataset.trajectories = String(c.trajectories);
    statusEl.dataset.calls = String(c.calls);
    statusEl.dataset.tokens = String(c.tokens);
    statusEl.textContent = "rendered step " + state.step + ": " + c.trajectories + " trajectories, " + c.calls + " calls, " + c.tokens + " tokens";
    document.title = "rljax report: ok";
  }
  try { render(); } catch (e) { fail(e && e.stack ? e.stack : String(e)); }
})();
