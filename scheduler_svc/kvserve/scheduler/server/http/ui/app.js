// kvserve's built-in page: a chat playground and a live view of the engine's KV-cache block pool.
// Plain ES2020 with no build step and no libraries: the server's CSP allows same-origin files only.

const VIEW_VERSION = 1;
const RECONNECT_MIN_MS = 500;
const RECONNECT_MAX_MS = 5000;
// A live stream that sends nothing for this long is presumed dead (the server sends a view
// every stream_interval_s), so the page reconnects instead of showing a frozen view as live.
const STALL_MIN_MS = 15000;
const STALL_INTERVALS = 20;
const STEP_SLOTS = 64; // the server sends at most 64 steps; fixed slots keep bar widths steady

const POOL_STATES = ['free', 'running', 'cached', 'shared', 'other'];
const POOL_STATE_BY_CHAR = { f: 'free', r: 'running', c: 'cached', s: 'shared', o: 'other' };
const CPU_STATE_BY_CHAR = { f: 'free', w: 'swapped' };
const STATE_LABELS = { free: 'free', running: 'running', cached: 'cached', shared: 'shared', other: 'another tenant' };
// Ref counts implied by a state, for cells the view's `refs` list does not name.
const IMPLIED_REFS = { running: '1', cached: '0', shared: '>1' };

const SVG_NS = 'http://www.w3.org/2000/svg';
const CHART = { height: 96, minWidth: 200, left: 34, right: 6, top: 22, bottom: 6 };

const $ = (id) => document.getElementById(id);

// The token is kept in memory only: never in the URL, localStorage or cookies.
const session = { auth: false, token: null, model: null, streamIntervalS: 1 };
// The models the picker lists: each id's parent (null for the base model, the base model's id for
// a LoRA adapter), and the one load in flight, which later callers share.
const models = { parents: new Map(), loading: null };
const chat = { turns: [], controller: null };
const events = { running: false, controller: null };

// An error to show in a reply bubble: the server's message, and the parameter it names.
function apiError(message, param = null, status = 0) {
  return Object.assign(new Error(message), { param, status });
}

// ---------------------------------------------------------------- small helpers

function el(tag, className = '', text = '') {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== '') node.textContent = text;
  return node;
}

// Writes text only when it differs: every write makes the browser lay the engine column out
// again, thousands of cells included.
function setText(node, text) {
  if (node.textContent !== String(text)) node.textContent = text;
}

// Rebuilds `node`'s children only when `signature` changed, so parts that stay the same keep
// their hover and text selection and cost no layout.
const signatures = new WeakMap();
function rebuildIfChanged(node, signature, buildChildren) {
  if (signatures.get(node) === signature) return;
  signatures.set(node, signature);
  node.replaceChildren(...buildChildren());
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const nextDelay = (delay) => Math.min(delay * 2, RECONNECT_MAX_MS);

function countValues(values) {
  const counts = new Map();
  for (const value of values) counts.set(value, (counts.get(value) ?? 0) + 1);
  return counts;
}

// The smallest 1, 2 or 5 × 10^k at or above `value`: a round top for a chart's y axis.
function niceCeil(value) {
  const power = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((m) => m * power).find((top) => top >= value);
}

function formatCount(value) {
  return value >= 1000 ? `${value / 1000}k` : String(value);
}

// ---------------------------------------------------------------- server calls and sign-in

function signedIn() {
  return !session.auth || session.token !== null;
}

async function apiFetch(path, options = {}) {
  const headers = new Headers(options.headers);
  if (session.token) headers.set('Authorization', `Bearer ${session.token}`);
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) requireSignIn();
  return response;
}

async function errorFrom(response) {
  const body = await response.json().catch(() => null); // not JSON: the status line has to do
  const message = body?.error?.message ?? `HTTP ${response.status} ${response.statusText}`.trim();
  return apiError(message, body?.error?.param ?? null, response.status);
}

// The server refused the token (or wants one): forget it, stop the view and ask again.
function requireSignIn() {
  session.auth = true;
  session.token = null;
  events.controller?.abort();
  setStreamStatus('sign in');
  $('sign-in').hidden = false;
  openSignIn();
}

function openSignIn() {
  const dialog = $('auth-dialog');
  if (!dialog.open) dialog.showModal();
  $('auth-token').focus();
}

function onAuthSubmit(event) {
  event.preventDefault();
  const token = $('auth-token').value.trim();
  if (!token) return;
  session.token = token;
  $('auth-token').value = '';
  $('auth-dialog').close();
  $('sign-in').hidden = true;
  startSession();
}

async function loadConfig() {
  for (let delay = RECONNECT_MIN_MS; ; delay = nextDelay(delay)) {
    const config = await fetch('/ui/config', { cache: 'no-store' })
      .then((response) => (response.ok ? response.json() : null))
      .catch(() => null); // the server is not reachable yet: retry
    if (config) return config;
    setStreamStatus('reconnecting');
    await sleep(delay);
  }
}

// Reads /v1/models into the picker. Adapters can be loaded and unloaded while the server runs, so
// this runs again whenever the picker is focused or opened; calls made meanwhile share one fetch.
function loadModels() {
  models.loading ??= fetchModels().finally(() => {
    models.loading = null;
  });
  return models.loading;
}

async function fetchModels() {
  try {
    const response = await apiFetch('/v1/models', { cache: 'no-store' });
    if (!response.ok) return;
    const body = await response.json();
    renderModels(Array.isArray(body.data) ? body.data : []);
  } catch (err) {
    console.warn('loading the models failed:', err);
  }
}

function modelLabel(card) {
  return card.parent ? `${card.id} (LoRA of ${card.parent})` : card.id;
}

// The base model (under each of its names) first, then the adapters. The selection stays while the
// server still serves it, else it falls back to the base model.
function renderModels(cards) {
  const ordered = [...cards.filter((card) => !card.parent), ...cards.filter((card) => card.parent)];
  models.parents = new Map(ordered.map((card) => [card.id, card.parent ?? null]));
  if (!models.parents.has(session.model)) session.model = ordered[0]?.id ?? null;
  const picker = $('model');
  const signature = JSON.stringify(ordered.map((card) => [card.id, card.parent ?? null]));
  rebuildIfChanged(picker, signature, () => {
    if (!ordered.length) return [el('option', '', 'no model')];
    return ordered.map((card) => {
      const option = el('option', '', modelLabel(card));
      option.value = card.id;
      if (card.parent) option.dataset.parent = card.parent;
      return option;
    });
  });
  picker.value = session.model ?? '';
  picker.disabled = !ordered.length;
}

function onModelChange() {
  session.model = $('model').value || null;
}

function startSession() {
  loadModels();
  streamEvents();
}

// ---------------------------------------------------------------- server-sent events

// Yields {event, data} for each event of an SSE body; `onChunk` hears every chunk, comments included.
async function* readSse(body, onChunk = () => {}) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      onChunk();
      buffer += decoder.decode(value, { stream: true });
      const blocks = buffer.split(/\r?\n\r?\n/);
      buffer = blocks.pop(); // an event not yet terminated by a blank line
      for (const block of blocks) {
        const event = parseSseBlock(block);
        if (event) yield event;
      }
    }
  } finally {
    reader.cancel().catch(() => {}); // releases the connection when the consumer stops early
  }
}

function parseSseBlock(block) {
  let event = 'message';
  const data = [];
  for (const line of block.split(/\r?\n/)) {
    if (line.startsWith(':')) continue; // a comment, e.g. a keep-alive
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? '' : line.slice(colon + 1).replace(/^ /, '');
    if (field === 'event') event = value;
    else if (field === 'data') data.push(value);
  }
  return data.length ? { event, data: data.join('\n') } : null;
}

function setStreamStatus(state) {
  const status = $('stream-status');
  status.textContent = state;
  status.dataset.state = state.replace(' ', '-');
}

// EventSource cannot send an Authorization header, so the view is read with fetch and
// reconnected here with a capped back-off. One loop runs at a time.
async function streamEvents() {
  if (events.running) return;
  events.running = true;
  let delay = RECONNECT_MIN_MS;
  try {
    while (signedIn()) {
      const outcome = await readEvents(() => {
        delay = RECONNECT_MIN_MS;
      });
      if (outcome === 'off' || !signedIn()) return;
      setStreamStatus('reconnecting');
      $('engine').classList.add('stale');
      await sleep(delay);
      delay = nextDelay(delay);
    }
  } finally {
    events.running = false;
  }
}

// One connection to /ui/events: 'off' when the server serves no view, else 'ended' or 'failed'.
async function readEvents(onView) {
  const controller = new AbortController();
  events.controller = controller;
  const stallMs = Math.max(STALL_MIN_MS, STALL_INTERVALS * session.streamIntervalS * 1000);
  let timer = 0;
  const rearm = () => {
    clearTimeout(timer);
    timer = setTimeout(() => controller.abort(), stallMs);
  };
  try {
    rearm();
    const headers = { Accept: 'text/event-stream' };
    const response = await apiFetch('/ui/events', { headers, cache: 'no-store', signal: controller.signal });
    if (response.status === 404) {
      showViewOff();
      return 'off';
    }
    if (!response.ok) return 'failed';
    setStreamStatus('live');
    for await (const { event, data } of readSse(response.body, rearm)) {
      if (event !== 'view') continue;
      onView();
      scheduleRender(JSON.parse(data));
    }
    return 'ended';
  } catch (err) {
    if (err.name !== 'AbortError') console.warn('engine view stream:', err);
    return 'failed';
  } finally {
    clearTimeout(timer);
  }
}

function showViewOff() {
  setStreamStatus('view off');
  showEngineNotice('The engine view is off: this server was started with --no-ui.');
  $('engine').classList.add('off');
}

function showEngineNotice(text) {
  const notice = $('engine-notice');
  setText(notice, text);
  notice.hidden = !text;
}

// ---------------------------------------------------------------- engine view

let pendingView = null;

// Views can arrive faster than the screen refreshes (or while the tab is hidden): draw only the latest.
function scheduleRender(view) {
  if (pendingView === null) requestAnimationFrame(renderPendingView);
  pendingView = view;
}

function renderPendingView() {
  const view = pendingView;
  pendingView = null;
  if (view.v !== VIEW_VERSION) {
    showEngineNotice(`This page reads engine view version ${VIEW_VERSION}, the server sent ${view.v}: reload the page.`);
    return;
  }
  showEngineNotice('');
  $('engine').classList.remove('stale');
  renderPool(view.pool, view.disk);
  renderCpu(view.cpu);
  renderQueues(view.queues);
  renderStepsChart(view.steps ?? []);
  renderSeriesCharts(view.series ?? []);
  renderTree(view.tree);
  renderMeta(view);
}

// Updates a grid of cells in place: elements are reused and an attribute is written only when
// it changes, so thousands of cells can refresh several times a second.
function updateCells(grid, count, classOf, titleOf) {
  resizeGrid(grid, count);
  const cells = grid.children;
  for (let i = 0; i < count; i++) {
    const className = classOf(i);
    if (cells[i].className !== className) cells[i].className = className;
    const title = titleOf(i);
    if (cells[i].title !== title) cells[i].title = title;
  }
}

function resizeGrid(grid, count) {
  while (grid.children.length > count) grid.lastElementChild.remove();
  const added = document.createDocumentFragment();
  for (let i = grid.children.length; i < count; i++) {
    const cell = el('div');
    cell.dataset.index = String(i);
    added.append(cell);
  }
  grid.append(added);
}

function renderPool(pool, disk) {
  const states = Array.from(pool.cells, (char) => POOL_STATE_BY_CHAR[char] ?? 'unknown');
  const refs = new Map(pool.refs);
  const owners = ownersByCell(pool.owners, states.length);
  const titleOf = (i) => cellTitle(i, states[i], refs.get(i), owners[i], pool);
  updateCells($('pool-grid'), states.length, (i) => `cell ${states[i]}`, titleOf);
  renderLegend(states);
  const perCell = pool.blocks_per_cell > 1 ? ` · ${pool.blocks_per_cell} blocks per cell` : '';
  // The tiers below the pool (--kv-host-gb, --kv-disk-dir): what they hold and gave back instead of a prefill.
  const onDisk = disk
    ? ` · ${disk.tiers === 'DISK' ? 'disk tier' : disk.tiers === 'CPU' ? 'host tier' : 'host and disk tiers'}`
      + ` ${disk.blocks} blocks, ${disk.loaded + disk.host_loaded} loaded back`
      + (disk.host_loaded ? ` (${disk.host_loaded} from memory)` : '')
    : '';
  setText($('pool-summary'), `${pool.num_blocks} blocks × ${pool.block_size} tokens${perCell}${onDisk}`);
}

// For each cell, the ids of the requests whose runs cover it (undefined where none do).
function ownersByCell(owners, count) {
  const byCell = new Array(count);
  for (const owner of owners) {
    for (const [first, length] of owner.runs) {
      for (let i = first; i < Math.min(first + length, count); i++) (byCell[i] ??= []).push(owner.id);
    }
  }
  return byCell;
}

function blockLabel(index, pool) {
  const perCell = pool.blocks_per_cell;
  if (perCell <= 1) return `block ${index}`;
  const first = index * perCell;
  const last = Math.min(first + perCell, pool.num_blocks) - 1;
  return `blocks ${first}–${last}`;
}

function cellTitle(index, state, ref, owners, pool) {
  const parts = [blockLabel(index, pool), STATE_LABELS[state] ?? state];
  if (state !== 'free' && state !== 'other') parts.push(`ref ${ref ?? IMPLIED_REFS[state] ?? '?'}`);
  if (owners && state !== 'other') parts.push(owners.join(', '));
  return parts.join(' · ');
}

function buildLegend() {
  const items = POOL_STATES.map((state) => {
    const item = el('li');
    item.dataset.state = state;
    item.append(el('span', `swatch ${state}`), el('span', 'legend-label', STATE_LABELS[state]), el('span', 'legend-count', '0'));
    return item;
  });
  $('pool-legend').replaceChildren(...items);
}

function renderLegend(states) {
  const counts = countValues(states);
  for (const item of $('pool-legend').children) {
    const count = String(counts.get(item.dataset.state) ?? 0);
    item.dataset.count = count;
    setText(item.querySelector('.legend-count'), count);
  }
}

function renderCpu(cpu) {
  const shown = Boolean(cpu?.num_blocks);
  $('cpu-section').hidden = !shown;
  if (!shown) return;
  const states = Array.from(cpu.cells, (char) => CPU_STATE_BY_CHAR[char] ?? 'unknown');
  const titleOf = (i) => `cpu block ${i} · ${states[i] === 'swapped' ? 'holds a swapped-out block' : states[i]}`;
  updateCells($('cpu-grid'), states.length, (i) => `cell ${states[i]}`, titleOf);
  const swapped = countValues(states).get('swapped') ?? 0;
  setText($('cpu-summary'), `${swapped} of ${cpu.num_blocks} blocks in use`);
}

function renderQueues(queues) {
  setText($('queue-running'), queues.running);
  setText($('queue-waiting'), queues.waiting);
  setText($('queue-swapped'), queues.swapped);
}

function renderMeta(view) {
  const viewer = view.viewer.admin ? `${view.viewer.tenant} (admin)` : view.viewer.tenant;
  const meta = $('view-meta');
  const omitted = view.pool.owners_omitted > 0 ? ` · ${view.pool.owners_omitted} requests not named in the cells` : '';
  setText(meta, `step ${view.step} · executor ${view.executor} · viewing as ${viewer}${omitted}`);
  meta.classList.toggle('warn', view.executor !== 'ready');
}

function renderTree(tree) {
  // Ages count in whole seconds, so a tree that did not change is not rebuilt on every view.
  const signature = JSON.stringify(tree, (key, value) => (key === 'last_used_s' ? Math.round(value) : value));
  rebuildIfChanged($('prefix-tree'), signature, () => {
    const items = tree.subtrees.map(subtreeItem);
    if (!items.length) items.push(el('li', 'empty', 'no cached prefixes'));
    if (tree.omitted > 0) items.push(el('li', 'more', `+${tree.omitted} more`));
    return items;
  });
  setText($('tree-summary'), `${tree.nodes} nodes`);
}

function plural(count, noun) {
  return `${count} ${noun}${count === 1 ? '' : 's'}`;
}

function subtreeItem(node) {
  const item = el('li', 'subtree');
  item.dataset.hits = node.hits;
  item.dataset.blocks = node.blocks;
  item.dataset.tokens = node.tokens;
  const stats = `${plural(node.tokens, 'token')} · ${plural(node.blocks, 'block')} · ${plural(node.hits, 'hit')} · used ${Math.round(node.last_used_s)} s ago`;
  const edge = el('div', 'edge');
  edge.append(el('span', 'edge-text', node.text), el('span', 'edge-stats', stats));
  item.append(edge);
  if (node.children?.length) {
    const children = el('ul');
    children.append(...node.children.map(subtreeItem));
    item.append(children);
  }
  return item;
}

// ---------------------------------------------------------------- charts

function svgNode(tag, attributes, text = '') {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  if (text !== '') node.textContent = text;
  return node;
}

// Chart widths as last laid out. Reading clientWidth while drawing would force a layout of the
// whole engine column (thousands of cells) after each grid update.
const chartWidths = new Map();
const chartResizes = new ResizeObserver((entries) => {
  for (const entry of entries) chartWidths.set(entry.target, entry.contentRect.width);
});

// The plot area of a chart drawn at its on-screen width (one viewBox unit per pixel), so its
// text keeps one size however wide the column is.
function chartArea(svg) {
  const width = Math.max(chartWidths.get(svg) ?? svg.clientWidth, CHART.minWidth); // clientWidth: before the first report
  svg.setAttribute('viewBox', `0 0 ${width} ${CHART.height}`);
  const bottom = CHART.height - CHART.bottom;
  return { x: CHART.left, y: CHART.top, w: width - CHART.left - CHART.right, h: bottom - CHART.top, bottom };
}

// What every chart shows: baseline, top grid line, y labels, time span (top right) and current value (top left).
function chartFrame(area, maxLabel, spanLabel, valueLabel) {
  const right = area.x + area.w;
  return [
    svgNode('line', { class: 'grid-line', x1: area.x, y1: area.y, x2: right, y2: area.y }),
    svgNode('line', { class: 'axis', x1: area.x, y1: area.bottom, x2: right, y2: area.bottom }),
    svgNode('text', { class: 'axis-label', x: area.x - 4, y: area.y + 3, 'text-anchor': 'end' }, maxLabel),
    svgNode('text', { class: 'axis-label', x: area.x - 4, y: area.bottom, 'text-anchor': 'end' }, '0'),
    svgNode('text', { class: 'axis-label', x: right, y: 12, 'text-anchor': 'end' }, spanLabel),
    svgNode('text', { class: 'chart-value', x: area.x, y: 13 }, valueLabel),
  ];
}

function drawChart(svg, value, nodes) {
  svg.dataset.value = value;
  svg.replaceChildren(...nodes);
}

function renderStepsChart(allSteps) {
  const svg = $('chart-steps');
  const area = chartArea(svg);
  const steps = allSteps.slice(-STEP_SLOTS);
  const top = niceCeil(Math.max(1, ...steps.map(([, prefill, decode]) => prefill + decode)));
  const slot = area.w / STEP_SLOTS;
  const bars = steps.flatMap(([, prefill, decode], i) => {
    const x = area.x + (STEP_SLOTS - steps.length + i) * slot; // the newest step at the right edge
    return [stepBar(area, x, slot, 0, decode, top, 'decode'), stepBar(area, x, slot, decode, prefill, top, 'prefill')];
  });
  const last = steps[steps.length - 1];
  const label = last ? `${last[1]} prefill · ${last[2]} decode` : 'no steps yet';
  const frame = chartFrame(area, formatCount(top), last ? `last ${steps.length} steps` : '', label);
  drawChart(svg, last ? `${last[1]},${last[2]}` : '', [...frame, ...bars.filter(Boolean)]);
}

// One segment of a stacked bar, from `base` to `base + amount` on a 0..top scale; null when empty.
function stepBar(area, x, slot, base, amount, top, className) {
  if (amount <= 0) return null;
  const height = (amount / top) * area.h;
  const y = area.bottom - (base / top) * area.h - height;
  return svgNode('rect', { class: className, x: x + slot * 0.1, y, width: slot * 0.8, height });
}

function renderSeriesCharts(series) {
  const now = series[series.length - 1];
  const top = niceCeil(Math.max(1, ...series.map(([, tokensPerS]) => tokensPerS)));
  const throughput = series.map(([time, tokensPerS]) => [time, tokensPerS / top]);
  drawLineChart($('chart-throughput'), throughput, formatCount(top), now ? `${now[1].toFixed(1)} tok/s` : '', now?.[1]);
  // Seconds without prefix lookups have no hit rate (null): the line joins the seconds that had one.
  const hitRate = series.filter(([, , rate]) => rate !== null).map(([time, , rate]) => [time, rate]);
  const latest = hitRate[hitRate.length - 1];
  drawLineChart($('chart-hit-rate'), hitRate, '100%', latest ? `${Math.round(latest[1] * 100)}% hits` : '', latest?.[1]);
}

// A line with a light area under it; `points` are [unix_time, fraction of the plot's height].
function drawLineChart(svg, points, maxLabel, valueLabel, value) {
  const area = chartArea(svg);
  const first = points[0]?.[0] ?? 0;
  const span = Math.max((points[points.length - 1]?.[0] ?? 0) - first, 1);
  const xs = points.map(([time]) => (area.x + ((time - first) / span) * area.w).toFixed(1));
  const coords = points.map(([, fraction], i) => `${xs[i]},${(area.bottom - Math.min(Math.max(fraction, 0), 1) * area.h).toFixed(1)}`);
  const spanLabel = points.length ? `last ${Math.round(span)} s` : '';
  const nodes = chartFrame(area, maxLabel, spanLabel, points.length ? valueLabel : 'no data yet');
  if (points.length) {
    const outline = `${xs[0]},${area.bottom} ${coords.join(' ')} ${xs[xs.length - 1]},${area.bottom}`;
    nodes.push(svgNode('polygon', { class: 'area', points: outline }), svgNode('polyline', { class: 'line', points: coords.join(' ') }));
  }
  drawChart(svg, value === undefined ? '' : String(value), nodes);
}

// ---------------------------------------------------------------- chat

// The optional JSON schema: {schema} when empty or valid, {error} (also shown) when not.
function readSchema() {
  const text = $('json-schema').value.trim();
  let schema;
  let error = '';
  if (text) {
    try {
      schema = JSON.parse(text);
      if (typeof schema !== 'object' || schema === null || Array.isArray(schema)) error = 'The schema must be a JSON object.';
    } catch (err) {
      error = `Not valid JSON: ${err.message}`;
    }
  }
  const box = $('schema-error');
  box.textContent = error;
  box.hidden = !error;
  $('json-schema').setAttribute('aria-invalid', String(Boolean(error)));
  return { schema, error };
}

// A number input's value, or undefined (left out of the request: the server's default) when blank.
function numberSetting(id) {
  const value = $(id).valueAsNumber;
  return Number.isNaN(value) ? undefined : value;
}

function conversation() {
  const system = $('system-prompt').value.trim();
  return system ? [{ role: 'system', content: system }, ...chat.turns] : [...chat.turns];
}

function buildRequest(schema) {
  const body = {
    model: session.model,
    messages: conversation(),
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberSetting('temperature'),
    top_p: numberSetting('top-p'),
    max_tokens: numberSetting('max-tokens'),
  };
  if (schema) body.response_format = { type: 'json_schema', json_schema: { name: 'schema', schema } };
  return body;
}

// Runs `update` and keeps the message list pinned to the bottom if it was there already,
// so a reader who scrolled up is not dragged down by every token.
function keepScrolled(update) {
  const box = $('messages');
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  update();
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function appendMessage(role, text) {
  const message = el('div', `message ${role}`);
  message.append(el('div', 'content', text));
  $('messages').append(message);
  $('messages').scrollTop = $('messages').scrollHeight;
  return message;
}

function updateButtons() {
  const busy = chat.controller !== null;
  $('send').disabled = busy;
  $('stop').disabled = !busy;
  $('regenerate').disabled = busy || !chat.turns.some((turn) => turn.role === 'user');
  $('clear').disabled = busy || !$('messages').childElementCount;
}

function onSend() {
  const text = $('message').value;
  if (!text.trim() || chat.controller) return;
  const { schema, error } = readSchema();
  if (error) return;
  chat.turns.push({ role: 'user', content: text });
  appendMessage('user', text);
  $('message').value = '';
  streamReply(schema);
}

function onRegenerate() {
  if (chat.controller) return;
  const { schema, error } = readSchema();
  if (error) return;
  dropLastReply();
  if (chat.turns[chat.turns.length - 1]?.role === 'user') streamReply(schema);
}

function onClear() {
  if (chat.controller) return;
  chat.turns = [];
  $('messages').replaceChildren();
  updateButtons();
}

// Removes the last assistant bubble (a reply, or an error or stopped one) and its turn, if any.
function dropLastReply() {
  const last = $('messages').lastElementChild;
  if (last?.classList.contains('assistant')) last.remove();
  if (chat.turns[chat.turns.length - 1]?.role === 'assistant') chat.turns.pop();
}

async function streamReply(schema) {
  const message = appendMessage('assistant', '');
  message.classList.add('streaming');
  chat.controller = new AbortController();
  updateButtons();
  const reply = { text: '', model: null, usage: null, sentAt: performance.now(), firstAt: null, lastAt: null };
  try {
    if (!session.model) await loadModels();
    const body = JSON.stringify(buildRequest(schema));
    const headers = { 'Content-Type': 'application/json' };
    const response = await apiFetch('/v1/chat/completions', { method: 'POST', headers, body, signal: chat.controller.signal });
    if (!response.ok) throw await errorFrom(response);
    await readReply(response.body, reply, message.querySelector('.content'));
    chat.turns.push({ role: 'assistant', content: reply.text });
    keepScrolled(() => message.append(replyStats(reply)));
  } catch (err) {
    if (err.name === 'AbortError') markStopped(message, reply.text);
    else showReplyError(message, err);
    if (err.param === 'model') loadModels(); // e.g. an adapter unloaded since the list was read
  } finally {
    message.classList.remove('streaming');
    chat.controller = null;
    updateButtons();
  }
}

async function readReply(body, reply, content) {
  for await (const { data } of readSse(body)) {
    if (data === '[DONE]') return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw apiError(chunk.error.message, chunk.error.param);
    reply.model ??= chunk.model ?? null;
    const delta = chunk.choices?.[0]?.delta?.content;
    if (delta) {
      const now = performance.now();
      reply.firstAt ??= now;
      reply.lastAt = now;
      reply.text += delta;
      keepScrolled(() => content.append(delta));
    }
    if (chunk.usage) reply.usage = chunk.usage;
  }
  throw apiError('The reply stream ended before it was complete.');
}

function replyStats({ model, usage, sentAt, firstAt, lastAt }) {
  const stats = el('div', 'reply-stats');
  const parts = [];
  const add = (key, value, text) => {
    stats.dataset[key] = String(value);
    parts.push(text);
  };
  // The model that answered, as the server names it; named in the text when it is a LoRA adapter.
  if (model !== null) stats.dataset.model = model;
  if (models.parents.get(model)) parts.push(`LoRA ${model}`);
  if (usage) {
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    add('promptTokens', usage.prompt_tokens, `prompt ${usage.prompt_tokens}`);
    add('cachedTokens', cached, `cached ${cached}`);
    add('completionTokens', usage.completion_tokens, `completion ${usage.completion_tokens}`);
  }
  if (firstAt !== null) {
    const ttft = Math.round(firstAt - sentAt);
    add('ttftMs', ttft, `TTFT ${ttft} ms`);
  }
  const tokens = usage?.completion_tokens ?? 0;
  if (tokens >= 2 && lastAt > firstAt) {
    const rate = (tokens / ((lastAt - firstAt) / 1000)).toFixed(1);
    add('tokensPerS', rate, `${rate} tok/s`);
  }
  stats.textContent = parts.join(' · ');
  return stats;
}

// A stopped reply keeps its partial text, in the page and in the conversation.
function markStopped(message, text) {
  message.classList.add('stopped');
  keepScrolled(() => message.append(el('div', 'reply-note', 'stopped')));
  if (text) chat.turns.push({ role: 'assistant', content: text });
}

function showReplyError(message, err) {
  message.classList.add('error');
  let text = err.param ? `${err.message} (param: ${err.param})` : err.message;
  if (err.status === 401) text += ' Sign in, then press Regenerate.';
  keepScrolled(() => message.append(el('div', 'reply-error', text)));
}

// ---------------------------------------------------------------- start

function onMessageKey(event) {
  if (event.key !== 'Enter' || event.shiftKey || event.isComposing) return;
  event.preventDefault();
  onSend();
}

function wireControls() {
  $('composer').addEventListener('submit', (event) => {
    event.preventDefault();
    onSend();
  });
  $('message').addEventListener('keydown', onMessageKey);
  $('stop').addEventListener('click', () => chat.controller?.abort());
  $('regenerate').addEventListener('click', onRegenerate);
  $('clear').addEventListener('click', onClear);
  $('json-schema').addEventListener('input', readSchema);
  $('auth-form').addEventListener('submit', onAuthSubmit);
  $('sign-in').addEventListener('click', openSignIn);
  $('model').addEventListener('change', onModelChange);
  // Focus covers the keyboard and the first click; pointerdown a click on the picker while focused.
  $('model').addEventListener('focus', loadModels);
  $('model').addEventListener('pointerdown', loadModels);
}

async function main() {
  wireControls();
  buildLegend();
  for (const id of ['chart-steps', 'chart-throughput', 'chart-hit-rate']) chartResizes.observe($(id));
  renderStepsChart([]);
  renderSeriesCharts([]);
  const config = await loadConfig();
  session.auth = Boolean(config.auth);
  session.streamIntervalS = Number(config.stream_interval_s) || session.streamIntervalS;
  if (session.auth) requireSignIn();
  else startSession();
}

main();
