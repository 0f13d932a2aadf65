// Live updates and confirmations for the durably dashboard (no build step).
// The page's <main data-live=URL> names an SSE stream; on a "runs" event the
// page is fetched again and <main> swapped, so what shows is always what the
// server renders (and escapes).
(function () {
  "use strict";
  var main = document.getElementById("live");
  var dot = document.getElementById("live-dot");
  document.addEventListener("click", function (event) {
    var button = event.target.closest("button[data-confirm]");
    if (button && !window.confirm(button.getAttribute("data-confirm"))) {
      event.preventDefault();
    }
  });
  if (!main || !main.dataset.live || !window.EventSource) { return; }
  var busy = false, again = false;
  function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    fetch(window.location.href, { credentials: "same-origin" })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (html === null) { return; }
        var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("live");
        var active = document.activeElement;
        // Never swap under someone typing into a form.
        if (fresh && !(active && main.contains(active) && /INPUT|TEXTAREA|SELECT/.test(active.tagName))) {
          main.innerHTML = fresh.innerHTML;
          main.dataset.refreshed = String(Date.now());
        }
      })
      .finally(function () {
        busy = false;
        if (again) { again = false; refresh(); }
      });
  }
  var source = new EventSource(main.dataset.live);
  source.addEventListener("open", function () { if (dot) { dot.classList.add("on"); } });
  source.addEventListener("error", function () { if (dot) { dot.classList.remove("on"); } });
  source.addEventListener("runs", refresh);
})();
