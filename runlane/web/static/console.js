/* runlane web console: live updates in place, the pause toggle, copy buttons.
   Served from the console's own origin (the CSP allows 'self' scripts only); no library.

   Live: every element with a data-live id is refreshed from a fresh GET of the same page
   (the whole page is rendered once, parsed here, and only those elements are swapped), every
   data-refresh seconds, while the tab is visible and nobody is typing in a form inside one.
   The pause toggle (remembered per browser) stops it; without this script, the page does
   not update (nothing reloads it under a reader's feet). */
(function () {
  "use strict";
  var KEY = "runlane-live";
  var body = document.body;
  var seconds = parseFloat(body.getAttribute("data-refresh") || "0");
  var toggle = document.getElementById("live-toggle");
  var state = document.getElementById("live-state");
  var liveText = state ? state.textContent : "";
  var timer = null;
  var busy = false;

  function paused() {
    try { return window.localStorage.getItem(KEY) === "paused"; } catch (e) { return false; }
  }

  function show() {
    var off = paused();
    body.setAttribute("data-live-state", off ? "paused" : "live");
    if (toggle) {
      toggle.textContent = off ? "Resume live updates" : "Pause live updates";
      toggle.setAttribute("aria-pressed", off ? "true" : "false");
    }
    if (state) {
      state.textContent = off ? "Live updates are paused." : liveText;
    }
  }

  /* a ticked row of the runs list (a selection for a bulk action) holds live updates: a
     swap would replace the rows under the reader's ticks */
  function selecting() {
    return document.querySelector("[data-live] input.pick:checked") !== null;
  }

  function typing() {
    var active = document.activeElement;
    if (!active || active === body) { return false; }
    var tag = active.tagName;
    if (tag === "INPUT" && active.type === "checkbox") { return false; } /* see selecting() */
    return (tag === "INPUT" || tag === "SELECT" || tag === "TEXTAREA") &&
      active.closest("[data-live]") !== null;
  }

  function swap(html) {
    var fresh = new DOMParser().parseFromString(html, "text/html");
    var parts = document.querySelectorAll("[data-live]");
    for (var i = 0; i < parts.length; i++) {
      var old = parts[i];
      var next = fresh.querySelector('[data-live="' + old.getAttribute("data-live") + '"]');
      if (next && next.innerHTML !== old.innerHTML) {
        old.innerHTML = next.innerHTML;
      }
    }
    var stamp = fresh.getElementById("updated-at");
    var mine = document.getElementById("updated-at");
    if (stamp && mine) { mine.textContent = stamp.textContent; }
    body.setAttribute("data-updates", String(parseInt(body.getAttribute("data-updates") || "0", 10) + 1));
  }

  function tick() {
    /* data-ticks counts the timer's turns, paused or not (what a test waits on) */
    body.setAttribute("data-ticks", String(parseInt(body.getAttribute("data-ticks") || "0", 10) + 1));
    if (busy || paused() || document.hidden || typing() || selecting()) { return; }
    busy = true;
    fetch(window.location.href, { credentials: "same-origin", headers: { "X-Runlane-Live": "1" } })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) { if (html !== null && !paused()) { swap(html); } })
      .catch(function () { /* the next tick tries again */ })
      .then(function () { busy = false; });
  }

  if (toggle) {
    toggle.addEventListener("click", function () {
      try {
        if (paused()) { window.localStorage.removeItem(KEY); } else { window.localStorage.setItem(KEY, "paused"); }
      } catch (e) { /* storage refused: nothing to remember */ }
      show();
    });
  }
  show();
  if (seconds > 0 && document.querySelector("[data-live]")) {
    timer = window.setInterval(tick, seconds * 1000);
  }

  /* the runs list's select-all box ticks (or clears) every row of the page */
  document.addEventListener("change", function (event) {
    var box = event.target;
    if (!box || box.id !== "pick-all") { return; }
    var rows = document.querySelectorAll("input.pick[name=run_id]");
    for (var i = 0; i < rows.length; i++) { rows[i].checked = box.checked; }
  });

  /* copy buttons: data-copy holds the text (a run id) */
  document.addEventListener("click", function (event) {
    var button = event.target.closest ? event.target.closest("[data-copy]") : null;
    if (!button) { return; }
    var value = button.getAttribute("data-copy");
    function copied() { button.setAttribute("data-copied", "1"); button.textContent = "copied"; }
    function bySelection() {
      /* plain http on another host has no clipboard API; a refused permission neither */
      var area = document.createElement("textarea");
      area.value = value;
      area.setAttribute("readonly", "");
      area.className = "offscreen";
      body.appendChild(area);
      area.select();
      try { if (document.execCommand("copy")) { copied(); } } catch (e) { /* copy by hand */ }
      body.removeChild(area);
    }
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(value).then(copied, bySelection);
    } else {
      bySelection();
    }
  });
  void timer;
}());
