// The inspector's few behaviours: uPlot charts with live refresh, token tooltips, filters that
// apply on change. Plain ES2017, no build step, no network beyond this app's own routes.
"use strict";
const Inspector = (() => {
  const base = document.body.dataset.base || "";
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf"];
  // Steps are integers: no tick at step 1.5.
  const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];

  function chartSize(el) {
    return { width: Math.max(el.clientWidth - 8, 240), height: 180 };
  }

  function makeChart(el, panel) {
    const opts = {
      title: panel.title,
      ...chartSize(el),
      scales: {
        x: { time: false },
        // A flat series (a KL of 0) gets a small range around it, not uPlot's 0..100.
        y: { range: (u, min, max) => (min === max ? [min - 1, max + 1] : uPlot.rangeNum(min, max, 0.1, true)) },
      },
      series: [{ label: "step" }].concat(panel.labels.map((label, i) => ({
        label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
        points: { show: panel.data[0].length < 60 },
      }))),
      axes: [{ label: "step", incrs: STEP_INCRS }, { size: 60 }],
      legend: { live: true },
    };
    return new uPlot(opts, panel.data, el);
  }

  function overview(refreshSeconds) {
    const holder = document.getElementById("charts");
    const charts = new Map();
    function render(curves) {
      for (const panel of curves.panels) {
        const known = charts.get(panel.title);
        if (known && known.labels.join() === panel.labels.join()) {
          known.plot.setData(panel.data);
          continue;
        }
        let el = document.querySelector(`[data-panel="${CSS.escape(panel.title)}"]`);
        if (!el) {
          el = document.createElement("div");
          el.className = "chart";
          el.dataset.panel = panel.title;
          holder.appendChild(el);
        }
        if (known) known.plot.destroy();
        charts.set(panel.title, { labels: panel.labels, plot: makeChart(el, panel) });
      }
      const last = document.getElementById("last-step");
      if (last && curves.last_step !== null) last.textContent = curves.last_step;
    }
    render(JSON.parse(document.getElementById("curves").textContent));
    async function refresh() {
      if (document.visibilityState === "visible") {
        try {
          const response = await fetch(`${base}/api/curves`, { cache: "no-store" });
          if (response.ok) render(await response.json());
        } catch (e) {
          // The run's host went away: keep the last curves; the next tick retries.
        }
      }
      setTimeout(refresh, refreshSeconds * 1000);
    }
    setTimeout(refresh, refreshSeconds * 1000);
    window.addEventListener("resize", () => {
      for (const { plot } of charts.values()) plot.setSize(chartSize(plot.root.parentNode));
    });
  }

  function trajectory() {
    const data = JSON.parse(document.getElementById("token-data").textContent);
    const tip = document.getElementById("tip");
    const text = document.getElementById("response");
    text.addEventListener("mouseover", (ev) => {
      const t = ev.target.closest(".t");
      if (!t) { tip.hidden = true; return; }
      const i = Number(t.dataset.i);
      const lp = data.lp[i];
      let s = `token ${i} · id ${data.ids[i]}`;
      s += data.has_lp ? ` · logprob ${lp.toFixed(4)} (p = ${Math.exp(lp).toFixed(3)})` : " · no rollout logprob";
      if (data.tis) s += ` · TIS weight ${data.tis[i].toFixed(3)}`;
      tip.textContent = s;
      const r = t.getBoundingClientRect();
      tip.style.left = `${r.left + window.scrollX}px`;
      tip.style.top = `${r.bottom + window.scrollY + 4}px`;
      tip.hidden = false;
    });
    text.addEventListener("mouseleave", () => { tip.hidden = true; });
  }

  // Filters apply as soon as a select changes (text fields on Enter or the button).
  for (const select of document.querySelectorAll("form.filters select")) {
    select.addEventListener("change", () => select.form.submit());
  }

  return { overview, trajectory };
})();
