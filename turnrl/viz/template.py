"""The report page: one Jinja template with its CSS and script.

Kept in Python (not a package data file) so that every install has it. The
template is rendered with autoescaping on: every string from a run (model
output, observations, env ids, file names) is escaped, and the script only
reads ``data-*`` attributes and sets ``hidden``/``open``/``textContent``.
"""

from __future__ import annotations

CSS = """
:root { --fg: #1d2330; --muted: #5f6b7a; --line: #d9dee5; --bg: #f6f7f9; --card: #fff;
        --ok: #1a7f37; --bad: #c62828; --warn: #9a6700; }
* { box-sizing: border-box; }
[hidden] { display: none !important; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg);
       background: var(--bg); }
header { padding: 16px 24px 8px; background: var(--card); border-bottom: 1px solid var(--line); }
header h1 { margin: 0 0 4px; font-size: 20px; }
header nav a { margin-right: 16px; color: #0b5cad; text-decoration: none; }
main { padding: 8px 24px 48px; max-width: 1500px; }
section { margin-top: 24px; }
h2 { font-size: 17px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
.muted { color: var(--muted); }
.warnings { background: #fff8e1; border: 1px solid #f0d98c; padding: 8px 12px; border-radius: 6px; }
.headline { display: flex; flex-wrap: wrap; gap: 10px; margin-bottom: 8px; }
.headline > div { background: var(--card); border: 1px solid var(--line); border-radius: 6px; padding: 6px 14px;
                  display: flex; flex-direction: column; min-width: 130px; }
.headline strong { font-size: 20px; font-variant-numeric: tabular-nums; }
.summary { display: grid; grid-template-columns: repeat(auto-fill, minmax(340px, 1fr)); gap: 0 16px;
           background: var(--card); border: 1px solid var(--line); border-radius: 6px; padding: 6px 12px; }
.summary > div { display: flex; justify-content: space-between; gap: 8px; border-bottom: 1px solid #eef0f3;
                 font-variant-numeric: tabular-nums; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; }
.plots figure { margin: 0; background: var(--card); border: 1px solid var(--line); border-radius: 6px; padding: 6px; }
table.variants { border-collapse: collapse; font-variant-numeric: tabular-nums; }
table.variants th, table.variants td { border-bottom: 1px solid var(--line); padding: 4px 12px; text-align: left; }
table.variants .num { text-align: right; }
.plots img { display: block; width: 440px; max-width: 100%; }
.filters { position: sticky; top: 0; z-index: 2; background: var(--bg); padding: 8px 0;
           display: flex; flex-wrap: wrap; gap: 14px; align-items: center; border-bottom: 1px solid var(--line); }
.filters label { color: var(--muted); }
.filters select, .filters button { font: inherit; padding: 2px 6px; }
details.episode, details.pair { background: var(--card); border: 1px solid var(--line); border-radius: 6px;
                                margin: 6px 0; scroll-margin-top: 56px; }
details > summary { cursor: pointer; padding: 6px 10px; list-style-position: inside; }
.episode-body { padding: 4px 12px 12px; }
.badge { display: inline-block; padding: 0 7px; border-radius: 9px; font-size: 12px; border: 1px solid var(--line); }
.badge.ok { color: #fff; background: var(--ok); border-color: var(--ok); }
.badge.bad { color: #fff; background: var(--bad); border-color: var(--bad); }
.badge.warn { color: var(--warn); border-color: #e0c36a; background: #fff8e1; }
.chip { display: inline-block; margin: 1px 4px 1px 0; padding: 0 6px; border-radius: 4px; background: #eef1f5;
        font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 12px; }
.chip.invalid { background: #fde2e2; color: var(--bad); text-decoration: line-through; }
.chip.no-effect { background: #fff8e1; color: var(--warn); }
.turn { display: grid; grid-template-columns: minmax(0, auto) minmax(0, 1fr); gap: 12px;
        border-top: 1px dashed var(--line); padding: 10px 0; }
.turn-images img, .episode-images img { image-rendering: pixelated; width: 192px; max-width: 100%;
                                         border: 1px solid var(--line); display: block; margin-bottom: 4px; }
.turn h4 { margin: 6px 0 2px; font-size: 12px; color: var(--muted); font-weight: 600; text-transform: uppercase; }
pre { margin: 0; white-space: pre-wrap; word-break: break-word; font: 12.5px/1.4 ui-monospace, SFMono-Regular,
      Menlo, monospace; background: #f8f9fb; border: 1px solid #eceff3; border-radius: 4px; padding: 6px 8px; }
.response .tag { opacity: .55; }
.f-think { background: #e8f0fe; }
.f-observation { background: #e6f4ea; }
.f-reasoning { background: #f3e8fd; }
.f-prediction { background: #fef7e0; }
.f-justification { background: #f3e8fd; }
.f-answer, .f-action { background: #fce8e6; font-weight: 600; }
.f-other { background: #eceff1; }
.pos { background: rgba(214, 39, 40, 0.6); }
.neg { background: rgba(31, 119, 180, 0.6); }
.legend span { padding: 0 6px; border-radius: 3px; margin-right: 6px; font-size: 12px; }
.heatmap .tok { border-radius: 2px; box-shadow: inset -1px 0 0 rgba(255, 255, 255, 0.8); }
.errors { color: var(--bad); font-size: 12.5px; margin: 4px 0; padding-left: 18px; }
.pair-grid { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; padding: 4px 12px 12px; }
.pair-grid > div > h3 { font-size: 13px; margin: 4px 0; }
.pair-grid .turn { grid-template-columns: 1fr; }
.turn-gap { border-top: 1px dashed #c9ced6; border-bottom: 1px dashed #c9ced6; padding: 6px 0; margin: 4px 0; }
"""

SCRIPT = """
(function () {
  "use strict";
  function value(id) {
    var element = document.getElementById(id);
    return element ? element.value : "all";
  }
  function matches(element, key, wanted) {
    return wanted === "all" || element.getAttribute("data-" + key) === wanted;
  }
  function applyFilters() {
    var wanted = {success: value("filter-success"), env: value("filter-env"),
                  status: value("filter-status"), source: value("filter-source")};
    var shown = 0;
    document.querySelectorAll("#episodes details.episode").forEach(function (element) {
      var keep = Object.keys(wanted).every(function (key) { return matches(element, key, wanted[key]); });
      element.hidden = !keep;
      if (keep) { shown += 1; }
    });
    document.querySelectorAll("#episodes .source").forEach(function (group) {
      group.hidden = !group.querySelector("details.episode:not([hidden])");
    });
    var count = document.getElementById("shown-count");
    if (count) { count.textContent = String(shown); }
  }
  function applyPairFilter() {
    var wanted = value("filter-pairs"), shown = 0;
    document.querySelectorAll("#pairs details.pair").forEach(function (element) {
      var keep = matches(element, "change", wanted);
      element.hidden = !keep;
      if (keep) { shown += 1; }
    });
    var count = document.getElementById("pairs-shown");
    if (count) { count.textContent = String(shown); }
  }
  function setOpen(selector, open) {
    document.querySelectorAll(selector).forEach(function (element) {
      if (!element.hidden) { element.open = open; }
    });
  }
  ["filter-success", "filter-env", "filter-status", "filter-source"].forEach(function (id) {
    var element = document.getElementById(id);
    if (element) { element.addEventListener("change", applyFilters); }
  });
  var pairs = document.getElementById("filter-pairs");
  if (pairs) { pairs.addEventListener("change", applyPairFilter); }
  var expand = document.getElementById("expand-all");
  if (expand) { expand.addEventListener("click", function () { setOpen("#episodes details.episode", true); }); }
  var collapse = document.getElementById("collapse-all");
  if (collapse) { collapse.addEventListener("click", function () { setOpen("#episodes details.episode", false); }); }
  applyFilters();
  applyPairFilter();
})();
"""

TEMPLATE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy"
      content="script-src 'nonce-{{ nonce }}'; object-src 'none'; base-uri 'none'">
<link rel="icon" href="data:,">
<title>turnrl · {{ data.title }}</title>
<style>{{ css|safe }}</style>
</head>
<body>
{#- A non-finite figure (a reward function's NaN) is marked, never a plain number that could pass for one. -#}
{%- macro marked(value, spec) -%}
{%- if value is finite %}{{ figure(value, spec) }}{% else -%}
<span class="badge bad" title="not a finite number">{{ figure(value, spec) }}</span>
{%- endif -%}
{%- endmacro -%}
{%- macro num(value) -%}{{ marked(value, ".4g") }}{%- endmacro -%}
{%- macro signed(value) -%}{{ marked(value, "+.3g") }}{%- endmacro -%}
{%- macro outcome(success) -%}
{% if success %}<span class="badge ok">success</span>{% else %}<span class="badge bad">failure</span>{% endif %}
{%- endmacro -%}
{%- macro result(ep) -%}
{{ outcome(ep.success) }} reward <strong>{{ num(ep.total_reward) }}</strong> in {{ ep.turns|length }}
{{- " turn" if ep.turns|length == 1 else " turns" }}
{%- endmacro -%}

{%- macro response_block(turn) -%}
<pre class="response">{% for seg in segments(turn.response, turn.fields) -%}
<span class="{{ seg.css_class }}">{{ seg.text }}</span>
{%- endfor %}</pre>
{%- endmacro -%}

{%- macro heatmap(advantages, scale) -%}
<pre class="heatmap">{% for token in advantages.tokens -%}
{%- set value = advantages.advantages[loop.index0] -%}
<span class="tok" style="background: {{ color(value, scale) }}" title="{{ figure(value, "+.3g") }}">{{ token }}</span>
{%- endfor %}</pre>
{%- endmacro -%}

{%- macro images(urls, alt) -%}
{%- for url in urls %}<img src="{{ url }}" alt="{{ alt }}" loading="lazy">{% endfor -%}
{%- endmacro -%}

{%- macro turn_block(turn, scale) -%}
<div class="turn">
  <div class="turn-images">{{ images(turn.images, "observation of turn %d" % (turn.index + 1)) }}</div>
  <div class="turn-text">
    <strong>Turn {{ turn.index + 1 }}</strong>
    <span class="muted">· reward <strong>{{ signed(turn.reward) }}</strong>
      {%- for name, value in turn.rewards.items() %} · {{ name }} {{ signed(value) }}{% endfor %}
      {%- if turn.num_response_tokens %} · {{ turn.num_response_tokens }} tokens{% endif %}
      {%- if turn.weights_version is not none %} · weights v{{ turn.weights_version }}{% endif %}
      · finish {{ turn.finish_reason or "?" }}</span>
    {% if turn.format_ok -%}
    <span class="badge ok">format ok</span>
    {%- else -%}
    <span class="badge bad">format error</span>
    {%- endif %}
    <h4>Observation</h4>
    <pre>{{ turn.prompt }}</pre>
    <h4>Response</h4>
    {{ response_block(turn) }}
    <h4>Actions</h4>
    <div>
    {%- for action in turn.actions -%}
      {%- set valid = turn.actions_valid[loop.index0] if loop.index0 < turn.actions_valid|length else true -%}
      {%- set effective = turn.actions_effective[loop.index0] if loop.index0 < turn.actions_effective|length
                          else true -%}
      {%- set kind = 'invalid' if not valid else ('no-effect' if not effective else '') -%}
      <span class="chip{{ ' ' ~ kind if kind }}"
            title="{{ 'invalid' if not valid else ('valid, changed nothing' if not effective else 'valid') }}">
        {{- action -}}
      </span>
    {%- else -%}
      <span class="muted">none</span>
    {%- endfor -%}
    </div>
    {% if turn.parse_errors or turn.reward_errors %}
    <ul class="errors">
      {%- for error in turn.parse_errors %}<li>{{ error }}</li>{% endfor -%}
      {%- for error in turn.reward_errors %}<li>reward error: {{ error }}</li>{% endfor -%}
    </ul>
    {% endif %}
    {% if turn.advantages is not none %}
    <h4>Per-token advantages</h4>
    {{ heatmap(turn.advantages, scale) }}
    {% endif %}
  </div>
</div>
{%- endmacro -%}

{%- macro episode_summary(ep, label) -%}
<summary>
  {% if label %}<span class="muted">[{{ label }}]</span>{% endif %}
  <strong>{{ ep.env_id }}</strong> seed {{ ep.seed }}{% if ep.sample %} #{{ ep.sample }}{% endif %}
  · {{ outcome(ep.success) }}
  <span class="badge{% if ep.status == 'error' %} bad{% elif ep.status == 'truncated' %} warn{% endif %}">
    {{- ep.status }}{% if ep.truncation_reason %}: {{ ep.truncation_reason }}{% endif -%}
  </span>
  · reward <strong>{{ num(ep.total_reward) }}</strong>
  · {{ ep.turns|length }} turn{{ "" if ep.turns|length == 1 else "s" }}
  {%- if ep.has_advantages %} · <span class="badge">advantages</span>{% endif %}
</summary>
{%- endmacro -%}

{%- macro episode_body(ep, scale) -%}
<div class="episode-body">
  <div class="muted">
    named rewards:
    {% for name, value in ep.named_rewards.items() -%}
      <span class="chip">{{ name }} {{ signed(value) }}</span>
    {%- else %}none{% endfor %}
    {%- if ep.env_metrics %} · env:
    {% for name, value in ep.env_metrics.items() -%}
      <span class="chip">{{ name }} {{ num(value) }}</span>
    {%- endfor %}{% endif %}
    · group {{ ep.group }} · line {{ ep.index + 1 }} of {{ ep.source }}.jsonl
  </div>
  {% if ep.error %}<ul class="errors"><li>{{ ep.error }}</li></ul>{% endif %}
  {% if ep.system_prompt -%}
  <details><summary class="muted">system prompt</summary><pre>{{ ep.system_prompt }}</pre></details>
  {%- endif %}
  {% if ep.images %}<div class="episode-images">{{ images(ep.images, "observation image") }}</div>{% endif %}
  {%- set head, hidden, tail = ep.turn_parts %}
  {% for turn in head %}{{ turn_block(turn, scale) }}{% endfor %}
  {% if hidden -%}
  {%- set first, last = head|length + 1, head|length + hidden -%}
  <p class="turn-gap muted">{{ hidden }} more turn{{ "s" if hidden > 1 else "" }} (turns {{ first }} to {{ last }}
    {{- " of " ~ ep.turns|length }}) not shown to keep the page light; turnrl view --max-turns N shows more.</p>
  {%- endif %}
  {% for turn in tail %}{{ turn_block(turn, scale) }}{% endfor %}
  <div class="turn">
    <div class="turn-images">{{ images(ep.final_images, "final observation") }}</div>
    <div class="turn-text"><h4>Final observation</h4><pre>{{ ep.final_observation }}</pre></div>
  </div>
</div>
{%- endmacro -%}

{%- macro options(values) -%}
<option value="all">all</option>
{%- for value, label in values %}<option value="{{ value }}">{{ label }}</option>{% endfor %}
{%- endmacro -%}

<header>
  <h1>{{ data.title }}</h1>
  <div class="muted">{{ data.kind }} · {{ data.folder }}</div>
  <nav>
    <a href="#summary">Summary</a>
    {% if data.variants %}<a href="#variants">Variants ({{ data.variants|length }})</a>{% endif %}
    {% if data.plots %}<a href="#curves">Training curves</a>{% endif %}
    {% if data.pairs %}<a href="#pairs">Before / after RL</a>{% endif %}
    <a href="#episodes">Episodes ({{ data.episode_count }})</a>
    {% if data.config_text %}<a href="#config">Config</a>{% endif %}
  </nav>
</header>
<main>
{% if data.warnings %}
<section class="warnings"><strong>Notes on reading this folder</strong>
  <ul>{% for warning in data.warnings %}<li>{{ warning }}</li>{% endfor %}</ul>
</section>
{% endif %}

<section id="summary">
  <h2>Summary</h2>
  {% if data.headline %}
  <div class="headline">
    {%- for key, value in data.headline %}
    <div><span class="muted">{{ key }}</span><strong>{{ value }}</strong></div>
    {%- endfor %}
  </div>
  {% endif %}
  {% if data.summary %}
  <details><summary>all figures of summary.json ({{ data.summary|length }})</summary>
  <div class="summary">
    {%- for key, value in data.summary %}
    <div><span class="muted">{{ key }}</span><span>{{ value }}</span></div>
    {%- endfor %}
  </div>
  </details>
  {% else %}<p class="muted">No summary.json (the run has not finished).</p>{% endif %}
</section>

{% if data.variants %}
<section id="variants">
  <h2>Env variants</h2>
  <p class="muted">One policy with the same agent settings on each env; each variant's episodes are below
    (filter "from"), and its folder is variants/&lt;variant&gt;/.</p>
  <table class="variants">
    <thead><tr><th>variant</th><th>env</th><th>settings</th>
      {%- for title in data.variant_columns %}<th class="num">{{ title }}</th>{% endfor %}</tr></thead>
    <tbody>
    {%- for row in data.variants %}
    <tr><td><strong>{{ row.name }}</strong></td><td>{{ row.env }}</td><td><code>{{ row.settings }}</code></td>
      {%- for value in row.figures %}<td class="num">{{ value }}</td>{% endfor %}</tr>
    {%- endfor %}
    </tbody>
  </table>
</section>
{% endif %}

{% if data.plots %}
<section id="curves">
  <h2>Training curves</h2>
  <p class="muted">Also saved as PNG files in plots/.</p>
  <div class="plots">
    {% for plot in data.plots %}<figure><img src="{{ plot.url }}" alt="{{ plot.title }}"></figure>{% endfor %}
  </div>
</section>
{% endif %}

{% if data.pairs %}
<section id="pairs">
  <h2>Before / after RL (validation)</h2>
  <p>{{ data.pair_counts.improved }} improved · {{ data.pair_counts.regressed }} regressed ·
     {{ data.pair_counts.unchanged }} unchanged, of {{ data.pairs|length }} validation episodes.</p>
  <div class="filters">
    <label>show <select id="filter-pairs">
      {{- options([("improved", "improved"), ("regressed", "regressed"), ("unchanged", "unchanged")]) -}}
    </select></label>
    <span><span id="pairs-shown">{{ data.pairs|length }}</span> shown</span>
  </div>
  {% for pair in data.pairs %}
  <details class="pair" data-change="{{ pair.change }}">
    <summary><strong>{{ pair.before.env_id }}</strong> seed {{ pair.before.seed }}
      {%- if pair.before.sample %} #{{ pair.before.sample }}{% endif %} ·
      before: {{ result(pair.before) }} ·
      after: {{ result(pair.after) }} · <em>{{ pair.change }}</em></summary>
    <div class="pair-grid">
      <div><h3>Before RL</h3>{{ episode_body(pair.before, data.scales[pair.before.source]) }}</div>
      <div><h3>After RL</h3>{{ episode_body(pair.after, data.scales[pair.after.source]) }}</div>
    </div>
  </details>
  {% endfor %}
</section>
{% endif %}

<section id="episodes">
  <h2>Episodes</h2>
  <p class="legend muted">Response fields:
    {% for name in field_classes %}<span class="f-{{ name }}">{{ name }}</span>{% endfor %}
    · per-token advantages: <span class="pos">positive</span><span class="neg">negative</span></p>
  <div class="filters">
    <label>outcome <select id="filter-success">{{ options([("1", "success"), ("0", "failure")]) }}</select></label>
    <label>env <select id="filter-env">{{ options(data.env_options) }}</select></label>
    <label>status <select id="filter-status">{{ options(data.status_options) }}</select></label>
    <label>from <select id="filter-source">{{ options(data.source_options) }}</select></label>
    <button type="button" id="expand-all">expand all</button>
    <button type="button" id="collapse-all">collapse all</button>
    <span><span id="shown-count">{{ data.episode_count }}</span> of {{ data.episode_count }} episodes shown</span>
  </div>
  {% for source in data.sources %}
  <div class="source">
    <h3>{{ source.label }} <span class="muted">({{ source.episodes|length }}
      {%- if source.total > source.episodes|length %} of {{ source.total }}{% endif %} episodes)</span></h3>
    {% for ep in source.episodes %}
    <details class="episode" data-success="{{ 1 if ep.success else 0 }}" data-env="{{ ep.env_id }}"
             data-status="{{ ep.status }}" data-source="{{ source.name }}">
      {{ episode_summary(ep, source.label) }}
      {{ episode_body(ep, source.advantage_scale) }}
    </details>
    {% endfor %}
  </div>
  {% else %}<p class="muted">No trajectories files.</p>
  {% endfor %}
</section>

{% if data.config_text %}
<section id="config">
  <h2>Config</h2>
  <details><summary>config.yaml</summary><pre>{{ data.config_text }}</pre></details>
</section>
{% endif %}
</main>
<script nonce="{{ nonce }}">{{ script|safe }}</script>
</body>
</html>
"""
