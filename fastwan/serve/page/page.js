// The page of `fastwan serve` at "/": a create form, the queue with progress bars, a gallery that plays the
// finished videos, delete buttons. Every call goes to this server's own API with "Authorization: Bearer <key>";
// the key is asked for once and kept in localStorage. Text from the API is only ever set as textContent.
"use strict";

const KEY_ITEM = "fastwan.apiKey";
const LIST_LIMIT = 100;  // the newest videos shown: one page of GET /v1/videos at its cap
const POLL_BUSY_MS = 1000;  // while a video is queued or running
const POLL_IDLE_MS = 5000;  // otherwise: videos other clients create still appear
const FIELDS = ["prompt", "negative_prompt", "size", "seconds", "num_inference_steps", "seed"];

// Live progress comes from polling GET /v1/videos, not from each video's event stream: one request covers every
// video on the page (other clients' too) and shows the ones removed elsewhere, whereas a stream per video holds
// one of the browser's six connections to this server for as long as the video waits and runs, and seven
// waiting videos would stall every other request of the page. A stream's per-step events are not needed for a
// bar that is redrawn each second. A causal model's running video is the exception: its mp4 is streamed while it
// is made (GET /v1/videos/{id}/stream, one connection per running video) and played as it grows.
const state = {
  cards: new Map(),    // id -> its <article>
  urls: new Map(),     // id -> the blob: URL of its mp4
  deleted: new Set(),  // ids deleted from this page: a list answer that was already on its way still names them
  timer: null,
  seq: 0,              // the latest list request; older answers are dropped
  model: null,
  streams: false,      // the model's running videos stream (GET /ready's "streams")
};

const $ = (id) => document.getElementById(id);

class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function showError(id, message) {
  $(id).textContent = message || "";
}

// One call to the API; an answer that is not 2xx throws ApiError with the server's message (OpenAI's
// {"error": {"message": ...}}), and a 401 also asks for the key again.
async function api(method, path, body) {
  const key = localStorage.getItem(KEY_ITEM);
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  let answer;
  try {
    answer = await fetch(path, { method, headers, body, cache: "no-store" });
  } catch (err) {
    throw new ApiError(0, `the server did not answer (${err.message}).`);
  }
  if (answer.ok) return answer;
  let message = `${method} ${path}: HTTP ${answer.status}`;
  let code = null;
  try {
    const data = await answer.json();
    if (data && data.error && data.error.message) message = data.error.message;
    if (data && data.error) code = data.error.code;
  } catch (_) {
    // not JSON: the status line stays the message
  }
  if (answer.status === 401) askKey(message);
  throw new ApiError(answer.status, message, code);
}

function askKey(message) {
  clearTimeout(state.timer);
  localStorage.removeItem(KEY_ITEM);
  $("app").hidden = true;
  $("forget-key").hidden = true;
  $("key-section").hidden = false;
  showError("key-error", message);
  $("key-input").value = "";
  $("key-input").focus();
}

function start() {
  $("key-section").hidden = true;
  $("app").hidden = false;
  $("forget-key").hidden = false;
  refresh();
}

async function checkReady() {
  try {
    const ready = await (await api("GET", "ready")).json();
    state.model = ready.model;
    state.streams = ready.streams === true;
    $("model").textContent = `model: ${ready.model}`;
  } catch (err) {
    if (err.status === 401) throw err;
    $("model").textContent = err.message;  // 503: the model is loading, or its load failed
  }
}

async function refresh() {
  clearTimeout(state.timer);
  const seq = ++state.seq;
  let busy = true;
  try {
    if (state.model === null) await checkReady();
    const list = await (await api("GET", `v1/videos?limit=${LIST_LIMIT}`)).json();
    if (seq !== state.seq) return;  // a newer refresh is on its way
    render(list.data);
    showError("error", null);
    busy = list.data.some((v) => v.status === "queued" || v.status === "in_progress");
  } catch (err) {
    if (err.status === 401 || seq !== state.seq) return;  // the key form is up; polling starts again with a key
    showError("error", err.message);
  }
  state.timer = setTimeout(refresh, busy ? POLL_BUSY_MS : POLL_IDLE_MS);
}

// The list (newest first) drawn: each video's card created or updated and placed in the queue or the gallery in
// list order; cards of videos no longer listed (deleted, expired) removed.
function render(videos) {
  const next = { queue: 0, gallery: 0 };
  const listed = new Set();
  for (const video of videos) {
    if (state.deleted.has(video.id)) continue;
    listed.add(video.id);
    const card = state.cards.get(video.id) || makeCard(video);
    update(card, video);
    const box = video.status === "completed" || video.status === "failed" ? "gallery" : "queue";
    const at = $(box).children[next[box]++];
    if (at !== card) $(box).insertBefore(card, at || null);  // moved only when out of place: a video keeps playing
  }
  for (const id of [...state.cards.keys()]) {
    if (!listed.has(id)) dropCard(id);
  }
  $("queue-empty").hidden = next.queue > 0;
  $("gallery-empty").hidden = next.gallery > 0;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function makeCard(video) {
  const card = element("article", "card");
  card.dataset.id = video.id;
  const bar = element("progress");
  bar.max = 100;
  const remove = element("button", "delete", "Delete");
  remove.type = "button";
  remove.addEventListener("click", () => deleteVideo(video.id, remove));
  card.append(element("div", "media"), element("p", "prompt", video.prompt), element("p", "meta"), bar,
    element("div", "actions"));
  card.querySelector(".actions").append(remove);
  state.cards.set(video.id, card);
  return card;
}

function update(card, video) {
  card.dataset.status = video.status;
  card.querySelector("progress").value = video.progress;
  card.querySelector(".meta").textContent = `${video.size} · ${video.seconds} s · ${video.status}` +
    (video.status === "in_progress" ? ` · ${video.progress}%` : "");
  const media = card.querySelector(".media");
  if (video.status === "queued" && media.dataset.shown === "stream") {  // back in the queue: its stream ended
    dropUrl(video.id);
    media.replaceChildren();
    delete media.dataset.shown;
  }
  if (video.status === "completed" && media.dataset.shown === "stream") delete media.dataset.shown;  // the file
  if (video.status === "in_progress" && state.streams && !media.dataset.shown) {
    media.dataset.shown = "stream";
    streamVideo(card);
  } else if (video.status === "failed" && !media.dataset.shown) {
    media.dataset.shown = "error";
    media.append(element("p", "error", (video.error && video.error.message) || "the video failed."));
  } else if (video.status === "completed" && !media.dataset.shown) {
    media.dataset.shown = "video";
    visible.observe(card);  // the mp4 is fetched once the card is on screen
  }
}

// <video src> cannot send the Authorization header: the mp4 is fetched with it and played from a blob: URL.
const visible = new IntersectionObserver((entries) => {
  for (const entry of entries) {
    if (entry.isIntersecting) {
      visible.unobserve(entry.target);
      loadVideo(entry.target);
    }
  }
}, { rootMargin: "300px" });

// The first bytes of an mp4 up to its avcC box give the H.264 codec string Media Source Extensions ask for
// ("avc1." and the profile, its compatibility flags and level, in hex); null until they have arrived.
function codecOf(bytes) {
  for (let i = 0; i + 8 < bytes.length; i++) {
    if (bytes[i] === 0x61 && bytes[i + 1] === 0x76 && bytes[i + 2] === 0x63 && bytes[i + 3] === 0x43) {  // "avcC"
      const hex = [...bytes.subarray(i + 5, i + 8)].map((b) => b.toString(16).padStart(2, "0")).join("");
      return `avc1.${hex}`;
    }
  }
  return null;
}

function concat(a, b) {
  const out = new Uint8Array(a.length + b.length);
  out.set(a);
  out.set(b, a.length);
  return out;
}

function appended(buffer, bytes) {
  return new Promise((resolve, reject) => {
    buffer.addEventListener("updateend", resolve, { once: true });
    buffer.addEventListener("error", reject, { once: true });
    buffer.appendBuffer(bytes);
  });
}

// A running video of a causal model: its growing mp4 (fetched with the key) fed to a MediaSource as it arrives,
// so the card plays the frames made so far.
async function streamVideo(card) {
  const id = card.dataset.id;
  const media = card.querySelector(".media");
  if (!window.MediaSource) return;
  let answer;
  try {
    answer = await api("GET", `v1/videos/${encodeURIComponent(id)}/stream`);
  } catch (err) {
    if (err.code === "not_streamable") state.streams = false;
    return;  // queued again, finished or deleted meanwhile: the next list shows it
  }
  const reader = answer.body.getReader();
  let head = new Uint8Array(0);
  let codec = null;
  while (codec === null) {
    const { done, value } = await reader.read();
    if (done || state.cards.get(id) !== card) return;
    head = concat(head, value);
    codec = codecOf(head);
  }
  const type = `video/mp4; codecs="${codec}"`;
  if (!MediaSource.isTypeSupported(type) || media.dataset.shown !== "stream") {
    reader.cancel();
    return;
  }
  const source = new MediaSource();
  const url = URL.createObjectURL(source);
  state.urls.set(id, url);
  const player = element("video");
  Object.assign(player, { src: url, controls: true, muted: true, autoplay: true, playsInline: true });
  media.replaceChildren(player);
  await new Promise((resolve) => source.addEventListener("sourceopen", resolve, { once: true }));
  try {
    const buffer = source.addSourceBuffer(type);
    let bytes = head;
    for (;;) {
      await appended(buffer, bytes);
      const { done, value } = await reader.read();
      if (done || state.urls.get(id) !== url) break;
      bytes = value;
    }
    if (source.readyState === "open") source.endOfStream();
  } catch (_) {
    // the card was dropped or the stream cut short: what arrived stays playable
  } finally {
    reader.cancel().catch(() => {});
  }
}

async function loadVideo(card) {
  const id = card.dataset.id;
  const media = card.querySelector(".media");
  let blob;
  try {
    blob = await (await api("GET", `v1/videos/${encodeURIComponent(id)}/content?variant=video`)).blob();
  } catch (err) {
    media.replaceChildren(element("p", "error", `the video could not be loaded: ${err.message}`));
    return;
  }
  if (state.cards.get(id) !== card) return;  // deleted while it downloaded
  dropUrl(id);  // the stream it played while it was made
  const url = URL.createObjectURL(blob);
  state.urls.set(id, url);
  const player = element("video");
  Object.assign(player, { src: url, controls: true, loop: true, muted: true, playsInline: true, preload: "auto" });
  const save = element("a", "download", "Download");
  Object.assign(save, { href: url, download: `${id}.mp4` });
  media.replaceChildren(player);
  card.querySelector(".actions").prepend(save);
}

function dropUrl(id) {
  if (state.urls.has(id)) {
    URL.revokeObjectURL(state.urls.get(id));
    state.urls.delete(id);
  }
}

function dropCard(id) {
  const card = state.cards.get(id);
  if (!card) return;
  visible.unobserve(card);
  card.remove();
  state.cards.delete(id);
  dropUrl(id);
  $("queue-empty").hidden = $("queue").children.length > 0;
  $("gallery-empty").hidden = $("gallery").children.length > 0;
}

async function deleteVideo(id, button) {
  button.disabled = true;
  try {
    await api("DELETE", `v1/videos/${encodeURIComponent(id)}`);
  } catch (err) {
    if (err.status !== 404) {  // 404: already gone, which is what was asked
      button.disabled = false;
      if (err.status !== 401) showError("error", err.message);
      return;
    }
  }
  state.deleted.add(id);
  dropCard(id);
}

async function createVideo(event) {
  event.preventDefault();
  const form = event.target;
  const body = new FormData();  // multipart: the one body that also carries the uploaded first frame
  for (const name of FIELDS) {
    const value = form.elements[name].value;
    if (value.trim() !== "") body.append(name, value);
  }
  const image = form.elements.input_reference.files[0];
  if (image) body.append("input_reference", image, image.name);
  $("create-button").disabled = true;
  try {
    await api("POST", "v1/videos", body);
    showError("form-error", null);
    refresh();
  } catch (err) {
    if (err.status !== 401) showError("form-error", err.message);
  } finally {
    $("create-button").disabled = false;
  }
}

function init() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    localStorage.setItem(KEY_ITEM, $("key-input").value.trim());
    $("key-input").value = "";
    start();
  });
  $("forget-key").addEventListener("click", () => askKey(null));
  $("create-form").addEventListener("submit", createVideo);
  if (localStorage.getItem(KEY_ITEM) === null) askKey(null);
  else start();
}

init();
