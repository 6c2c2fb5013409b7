// loraplex admin UI: the overview's live charts. Polls /admin/live.json every few seconds and redraws
// each <svg data-chart> as lines (a gap where an interval had no value) and the panel's tables. Every
// value goes in through textContent or an attribute, never as markup.
(() => {
  "use strict";
  const root = document.getElementById("live");
  if (!root) return;
  const NS = "http://www.w3.org/2000/svg";
  const W = 480, H = 160, LEFT = 48, RIGHT = 8, TOP = 10, BOTTOM = 22;
  const status = document.getElementById("live-status");

  function svgEl(name, attrs, text) {
    const node = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function short(v) {
    if (v === null || v === undefined) return "–";
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
    if (a >= 10 || v === 0) return v.toFixed(0);
    return v.toFixed(a >= 1 ? 1 : 2);
  }

  function clock(t) {
    return new Date(t * 1000).toISOString().slice(11, 19);
  }

  function lastValue(values) {
    for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null) return values[i];
    return null;
  }

  function draw(svg, chart, times) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const all = chart.series.flatMap((s) => s.values).filter((v) => v !== null);
    const top = Math.max(0, ...all) || 1;
    const n = times.length, plotW = W - LEFT - RIGHT, plotH = H - TOP - BOTTOM;
    const x = (j) => LEFT + (n > 1 ? (j * plotW) / (n - 1) : plotW);
    const y = (v) => TOP + plotH * (1 - v / top);
    svg.appendChild(svgEl("line", { class: "axis", x1: LEFT, y1: TOP + plotH, x2: W - RIGHT, y2: TOP + plotH }));
    svg.appendChild(svgEl("text", { class: "tick", x: LEFT - 4, y: TOP + 4, "text-anchor": "end" }, short(top)));
    svg.appendChild(svgEl("text", { class: "tick", x: LEFT - 4, y: TOP + plotH, "text-anchor": "end" }, "0"));
    if (n) {
      svg.appendChild(svgEl("text", { class: "tick", x: LEFT, y: H - 6 }, clock(times[0])));
      svg.appendChild(svgEl("text", { class: "tick", x: W - RIGHT, y: H - 6, "text-anchor": "end" }, clock(times[n - 1])));
    } else {
      svg.appendChild(svgEl("text", { class: "tick", x: LEFT + plotW / 2, y: TOP + plotH / 2, "text-anchor": "middle" },
        "no samples yet"));
    }
    chart.series.forEach((s, i) => {
      let d = "", pen = false;
      s.values.forEach((v, j) => {
        if (v === null) { pen = false; return; }
        d += (pen ? "L" : "M") + x(j).toFixed(1) + " " + y(v).toFixed(1);
        pen = true;
      });
      const last = lastValue(s.values);
      const path = svgEl("path", { class: "line s" + i, d: d || "M0 0", "data-series": s.name,
        "data-last": last === null ? "" : last, "data-max": Math.max(0, ...s.values.filter((v) => v !== null)) });
      path.appendChild(svgEl("title", {}, s.name + ": " + short(last) + (chart.unit ? " " + chart.unit : "")));
      svg.appendChild(path);
    });
    svg.dataset.points = String(n);
    svg.dataset.stamp = n ? String(times[n - 1]) : "";
    const legend = document.querySelector('[data-legend="' + chart.id + '"]');
    if (legend) {
      legend.textContent = "";
      chart.series.forEach((s, i) => {
        const swatch = document.createElement("span");
        swatch.className = "swatch s" + i;
        legend.append(swatch, " " + s.name + " " + short(lastValue(s.values)) + " ");
      });
    }
  }

  function fillCounts(table, recent, since) {
    const body = table.tBodies[0];
    body.textContent = "";
    const names = Object.keys(since);
    if (!names.length) {
      const row = body.insertRow(), cell = row.insertCell();
      cell.colSpan = 3; cell.className = "muted"; cell.textContent = "None.";
      return;
    }
    for (const name of names) {
      const row = body.insertRow();
      row.dataset.reason = name;
      row.insertCell().textContent = name;
      for (const v of [recent[name] || 0, since[name]]) {
        const cell = row.insertCell();
        cell.className = "num"; cell.textContent = String(v);
      }
    }
  }

  function fillWindow(w) {
    if (!w) return;
    fillCounts(document.getElementById("rejections"), w.rejections, w.rejections_since_start);
    fillCounts(document.getElementById("errors"), w.errors, w.errors_since_start);
    for (const kind of ["ttft", "latency"]) {
      const cells = document.querySelectorAll('#latency-summary tr[data-row="' + kind + '"] td');
      ["p50", "p95", "p99"].forEach((q, i) => { cells[i].textContent = short(w[kind][q]); });
    }
  }

  let every = 5000;
  async function poll() {
    try {
      const r = await fetch(root.dataset.source, { credentials: "same-origin", cache: "no-store" });
      if (!r.ok || !(r.headers.get("content-type") || "").includes("json")) {
        status.textContent = "not updating: log in again";
        return;
      }
      const data = await r.json();
      for (const chart of data.charts) {
        const svg = document.querySelector('svg[data-chart="' + chart.id + '"]');
        if (svg) draw(svg, chart, data.t);
      }
      fillWindow(data.window);
      every = Math.min(Math.max((data.interval_s || 5) * 1000, 1000), 5000);
      status.textContent = data.t.length ? "updated " + clock(data.t[data.t.length - 1]) + " UTC" : "waiting for samples";
    } catch (e) {
      status.textContent = "not updating: " + e.message;
    } finally {
      setTimeout(poll, every);
    }
  }
  poll();
})();
