// Talking to the server: the API key (asked for before the first API call when /ui/config says
// the server needs one, and again on a 401; kept in sessionStorage, sent as a header, never in a
// URL) and a reader of Server-Sent Events over fetch() (EventSource cannot send headers).

const KEY_NAME = "pagellm-api-key";
const CONFIG_PATH = "/ui/config"; // public: whether a key is needed, nothing more
let keyWaiters = [];
let config = null; // the promise of /ui/config's answer, once one came

export function apiKey() {
  return sessionStorage.getItem(KEY_NAME) || "";
}

export function authHeaders(extra = {}) {
  const headers = { ...extra };
  const key = apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

// Show the key prompt (once, however many callers wait) and resolve when a key is entered.
export function askForKey(message) {
  const dialog = document.getElementById("key-dialog");
  const text = document.getElementById("key-message");
  if (message) text.textContent = message;
  dialog.hidden = false;
  document.getElementById("status").dataset.state = "error";
  document.getElementById("status-text").textContent = "API key needed";
  document.getElementById("key-input").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

export function installKeyDialog() {
  const form = document.getElementById("key-form");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const input = document.getElementById("key-input");
    const key = input.value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_NAME, key);
    input.value = "";
    document.getElementById("key-dialog").hidden = true;
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((resolve) => resolve(key));
  });
}

// The server's page config; a failed fetch is not kept, so the next call asks again.
function serverConfig() {
  config = config || fetch(CONFIG_PATH)
    .then((response) => (response.ok ? response.json() : {}))
    .catch(() => {
      config = null;
      return {};
    });
  return config;
}

// Resolves once the page may call the API: at once without a key, else once one is entered, so
// that no call goes out (and is refused) before the key is asked for.
async function keyReady() {
  const { api_key_required: required } = await serverConfig();
  while (required && !apiKey()) await askForKey();
}

// fetch() with the key (asked for first where needed); a 401 asks for the key and tries again.
export async function apiFetch(path, options = {}) {
  await keyReady();
  for (;;) {
    const response = await fetch(path, { ...options, headers: authHeaders(options.headers || {}) });
    if (response.status !== 401) return response;
    const hadKey = Boolean(apiKey());
    await askForKey(hadKey ? "That key was refused. Enter the server's API key." : undefined);
  }
}

// The data of each event of an SSE response body, as strings, until the stream ends.
export async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

// An OpenAI-style error body as one line.
export async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}
