"""``report.html``: the certificate as one self-contained page (no network).

It opens with the verdict and the clause by layout grid, drawn as a
coloured matrix: a cell per clause and layout, coloured by the worst
verdict among its cases, layouts grouped by family; every cell links to the
list of its cases further down. Then the distinct deviations, the cases
that did not pass, and every cell's cases. The page draws itself from the
report's JSON, embedded in it.
"""

from __future__ import annotations

import html
import json

from hyperdsd.testing import Status

from ..world.layouts import FAMILIES

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px;margin:0 0 8px}h2{font-size:17px;margin:20px 0 6px}
.level{display:inline-block;padding:6px 12px;border-radius:4px;font-weight:600;margin:8px 0}
.level.yes{background:#c8e6c9;color:#1b5e20}.level.no{background:#ffcdd2;color:#b71c1c}
table{border-collapse:collapse;margin:12px 0}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:center}
th{background:#f5f5f5}
.meta td{text-align:left}
#matrix{font-size:11px}
#matrix td,#matrix th{padding:0}
#matrix th.family{padding:2px 4px;font-weight:600;background:#eceff1}
#matrix th.layout{writing-mode:vertical-rl;transform:rotate(180deg);padding:4px 1px;font-weight:400;
 font-family:monospace;white-space:nowrap;text-align:left;vertical-align:bottom}
#matrix td.clause{text-align:left;font-family:monospace;padding:1px 6px;white-space:nowrap}
#matrix td.cell{min-width:2.6em;height:1.6em}
#matrix td.cell a{display:block;color:inherit;text-decoration:none;padding:2px 2px;font-size:10px}
#matrix td.cell a:hover{outline:2px solid #333}
td.passed{background:#c8e6c9}td.failed{background:#ef9a9a}td.error{background:#e57373;color:#fff}
td.xfail{background:#ffe082}td.xpass{background:#fff59d}td.na{background:#e0e0e0;color:#666}td.empty{background:#fff}
.legend span{display:inline-block;padding:2px 8px;margin-right:6px;border:1px solid #ccc;font-size:12px}
.legend .passed{background:#c8e6c9}.legend .failed{background:#ef9a9a}.legend .error{background:#e57373;color:#fff}
.legend .xfail{background:#ffe082}.legend .xpass{background:#fff59d}.legend .na{background:#e0e0e0}
details{margin:4px 0}summary{cursor:pointer;font-family:monospace}
pre{background:#f7f7f7;padding:8px;overflow:auto;white-space:pre-wrap}
.spec{font-family:system-ui,sans-serif;font-size:12px;max-width:40em;text-align:left;white-space:normal;color:#444}
details.deviation{border-left:4px solid #e57373;padding-left:8px}details.deviation.xfail{border-color:#ffe082}
details.cell-cases:target{outline:2px solid #333}
ul.cases{margin:2px 0 8px;padding-left:20px;font-family:monospace;font-size:12px}
ul.cases .status{display:inline-block;min-width:5em;font-weight:600}
"""

# The page's script takes the status names from the enum, not from literals of its own.
_STATUSES = f"const S = {json.dumps({m.name: m.value for m in Status})};"
_FAMILIES = f"const FAMILIES = {json.dumps(list(FAMILIES) + ['other'])};"

_JS = """
const data = JSON.parse(document.getElementById('report-data').textContent);
const el = (tag, attrs = {}, text) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
};
const worstOf = (c) => [S.ERROR, S.FAILED, S.XFAIL, S.XPASS, S.NOT_APPLICABLE, S.PASSED].find(s => c[s]) || '';
const familyOf = (l) => (data.layout_families || {})[l] || 'other';
const clauses = [], seen = [], cells = {};
for (const c of data.cases) {
  if (!clauses.includes(c.clause)) clauses.push(c.clause);
  if (!seen.includes(c.layout)) seen.push(c.layout);
  const key = c.clause + '|' + c.layout;
  (cells[key] = cells[key] || {cases: [], counts: {}}).cases.push(c);
  cells[key].counts[c.status] = (cells[key].counts[c.status] || 0) + 1;
}
// Layouts grouped by family, in the order they first ran within each.
const layouts = [...seen].sort((a, b) =>
  (FAMILIES.indexOf(familyOf(a)) - FAMILIES.indexOf(familyOf(b))) || (seen.indexOf(a) - seen.indexOf(b)));
const cellId = (clause, layout) => 'cell-' + clauses.indexOf(clause) + '-' + layouts.indexOf(layout);
const table = el('table', {id: 'matrix'});
const fams = el('tr');
fams.appendChild(el('th', {class: 'family'}, ''));
for (let i = 0; i < layouts.length;) {
  const f = familyOf(layouts[i]);
  let n = 0;
  while (i + n < layouts.length && familyOf(layouts[i + n]) === f) n++;
  fams.appendChild(el('th', {class: 'family', colspan: String(n)}, f));
  i += n;
}
table.appendChild(fams);
const head = el('tr');
head.appendChild(el('th', {class: 'clause-head'}, 'clause'));
layouts.forEach(l => head.appendChild(el('th', {class: 'layout', title: l}, l)));
table.appendChild(head);
for (const clause of clauses) {
  const tr = el('tr');
  const td = el('td', {class: 'clause'});
  const text = (data.clauses || {})[clause];
  if (text) {
    const det = el('details');
    det.appendChild(el('summary', {}, clause));
    det.appendChild(el('div', {class: 'spec'}, text));
    td.appendChild(det);
  } else {
    td.textContent = clause;
  }
  tr.appendChild(td);
  for (const layout of layouts) {
    const cell = cells[clause + '|' + layout];
    if (!cell) {
      tr.appendChild(el('td', {class: 'cell empty', 'data-clause': clause, 'data-layout': layout}));
      continue;
    }
    const c = cell.counts;
    const total = cell.cases.length;
    const ran = total - (c[S.NOT_APPLICABLE] || 0);
    const w = worstOf(c);
    const title = `${clause} on ${layout}: ` + Object.entries(c).map(([s, n]) => `${n} ${s}`).join(', ');
    const td = el('td', {class: 'cell ' + (w === S.NOT_APPLICABLE ? 'na' : w), 'data-clause': clause,
      'data-layout': layout, 'data-status': w, title});
    td.appendChild(el('a', {href: '#' + cellId(clause, layout)},
      ran ? `${(c[S.PASSED] || 0) + (c[S.XPASS] || 0)}/${ran}` : S.NOT_APPLICABLE));
    tr.appendChild(td);
  }
  table.appendChild(tr);
}
document.getElementById('matrix-slot').replaceChildren(table);
// The colour each cell renders with, for tests that read the rendered page.
table.querySelectorAll('td[data-status]').forEach(td => \
td.setAttribute('data-bg', getComputedStyle(td).backgroundColor));
const devs = document.getElementById('deviations');
if (!(data.deviations || []).length) devs.appendChild(el('p', {}, 'No case failed.'));
(data.deviations || []).forEach((d, i) => {
  const box = el('details', {class: 'deviation ' + d.status, open: ''});
  box.appendChild(el('summary', {}, `D${i + 1}  ${d.status.toUpperCase()} in ${d.count} case(s) of \
${d.clauses.join(', ')}${d.xfail_reason ? '  (expected: ' + d.xfail_reason + ')' : ''}`));
  box.appendChild(el('pre', {}, d.message + '\\n\\nrepro: ' + d.repro));
  const list = el('details');
  list.appendChild(el('summary', {}, 'cases'));
  list.appendChild(el('pre', {}, d.cases.join('\\n')));
  box.appendChild(list);
  devs.appendChild(box);
});
const failures = data.cases.filter(c => [S.FAILED, S.ERROR, S.XFAIL, S.XPASS].includes(c.status));
const list = document.getElementById('failures');
if (!failures.length) list.appendChild(el('p', {}, 'Every case that ran passed or did not apply.'));
for (const c of failures) {
  const d = el('details', {class: c.status});
  d.appendChild(el('summary', {}, \
`${c.status.toUpperCase()}  ${c.id}${c.xfail_reason ? '  (' + c.xfail_reason + ')' : ''}`));
  d.appendChild(el('pre', {}, c.message + '\\n\\nrepro: ' + c.repro));
  list.appendChild(d);
}
const byCell = document.getElementById('cells');
for (const clause of clauses) {
  for (const layout of layouts) {
    const cell = cells[clause + '|' + layout];
    if (!cell) continue;
    const d = el('details', {class: 'cell-cases', id: cellId(clause, layout)});
    const counts = Object.entries(cell.counts).map(([s, n]) => `${n} ${s}`).join(', ');
    d.appendChild(el('summary', {}, `${clause} on ${layout}: ${counts}`));
    const ul = el('ul', {class: 'cases'});
    for (const c of cell.cases) {
      const li = el('li', {class: c.status});
      li.appendChild(el('span', {class: 'status'}, c.status));
      const first = (c.message || '').split('\\n')[0];
      li.appendChild(document.createTextNode(c.id + (first ? '  ' + first : '')));
      ul.appendChild(li);
    }
    d.appendChild(ul);
    byCell.appendChild(d);
  }
}
// A cell's link opens its list of cases.
const openTarget = () => {
  const target = location.hash && document.getElementById(location.hash.slice(1));
  if (target && target.tagName === 'DETAILS') { target.open = true; target.scrollIntoView(); }
};
window.addEventListener('hashchange', openTarget);
openTarget();
document.body.setAttribute('data-rendered', 'yes');
"""

_LEGEND = (
    '<p class="legend">'
    + "".join(
        f'<span class="{cls}">{label}</span>'
        for cls, label in (
            ("passed", "passed"),
            ("failed", "failed"),
            ("error", "error"),
            ("xfail", "expected failure"),
            ("xpass", "unexpected pass"),
            ("na", "not applicable"),
        )
    )
    + " Each cell: cases passed / cases run, coloured by the worst verdict among them; "
    "click it for its cases.</p>"
)


def render_html(data: dict, verdict: str, first_lines: list[str], reached) -> str:
    """The page for a report's ``data`` (report.json's), its ``verdict`` and
    the certificate's ``first_lines``; ``reached(entry)`` words a profile's level."""
    impl = data["impl"]
    rows = [
        ("implementation", f"{impl['spec']} ({impl['name']} {impl['version']})"),
        ("spec / suite", f"{data['spec_version']} / {data['suite_version']}"),
        ("torch", data["torch_version"]),
        ("machine", f"{data['machine']}, Python {data['python']}"),
        ("world sizes / meshes", f"{', '.join(map(str, data['world_sizes']))} / {', '.join(data['meshes'])}"),
        ("started", f"{data['started']} ({data['elapsed_s']:.0f} s)"),
        ("summary", " | ".join(f"{k}: {n}" for k, n in data["summary"].items())),
    ]
    rows += [(f"profile {p}", f"{reached(v)}: {v['why']}") for p, v in data["level"].items()]
    meta = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    payload = json.dumps(data).replace("</", "<\\/")
    title = f"Conformance report: {html.escape(impl['name'])} {html.escape(impl['version'])}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>{title}</title>
<style>{_CSS}</style></head>
<body>
<h1>{title}</h1>
<div class="level {"yes" if verdict == "core certified" else "no"}" id="level">Level: {html.escape(verdict)}</div>
{"".join(f'<p class="coverage">{html.escape(line)}</p>' for line in first_lines[1:])}
<h2>Clause by layout</h2>
{_LEGEND}
<div id="matrix-slot"><noscript>The matrix needs JavaScript; \
report.md and report.json hold the same data.</noscript></div>
<table class="meta">{meta}</table>
<h2>Distinct deviations</h2>
<p>Failing cases grouped by cause: the same error or difference, with case-specific names and numbers masked.</p>
<div id="deviations"></div>
<h2>Cases that did not pass</h2>
<div id="failures"></div>
<h2>Cases by cell</h2>
<div id="cells"></div>
<script type="application/json" id="report-data">{payload}</script>
<script>{_STATUSES}{_FAMILIES}{_JS}</script>
</body></html>
"""
