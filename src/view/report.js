// kvreplay report pages: every table sorts by the column clicked (numbers by value, an interval
// "x [lo, hi]" by its estimate x; a second click reverses).
"use strict";
window.addEventListener("error", (event) => { document.body.dataset.error = String(event.message); });

function sortKey(text) {
  const number = parseFloat(text.replace(/[−–]/g, "-"));
  return Number.isNaN(number) ? text : number;
}

function sortable(table) {
  const body = table.tBodies[0];
  if (!body || !table.tHead) return;
  Array.from(table.tHead.rows[0].cells).forEach((th, column) => {
    th.title = "sort by this column";
    th.addEventListener("click", () => {
      const rows = Array.from(body.rows);
      const descending = th.dataset.order !== "descending";
      rows.sort((a, b) => {
        const x = sortKey(a.cells[column].textContent), y = sortKey(b.cells[column].textContent);
        const order = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
        return descending ? -order : order;
      });
      th.dataset.order = descending ? "descending" : "ascending";
      rows.forEach((row) => body.appendChild(row));
    });
  });
}

document.querySelectorAll("table").forEach(sortable);
// `#sort=N` sorts the first table by column N on opening, as a click would.
const sortOnOpen = /^#sort=(\d+)$/.exec(location.hash);
if (sortOnOpen && document.querySelector("table")) document.querySelector("table").tHead.rows[0].cells[Number(sortOnOpen[1])].click();
document.body.dataset.tables = String(document.querySelectorAll("table").length);
document.body.dataset.rendered = "ok";
