"""The search page the service shows at `/`: static HTML whose script calls `POST /search` with the
token typed into it (kept in the tab's session storage only)."""

SEARCH_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>densekit search</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
  body { font-family: system-ui, sans-serif; max-width: 52rem; margin: 2rem auto; padding: 0 1rem;
         color: #222; }
  h1 { font-size: 1.4rem; margin-bottom: 0.2rem; }
  #info { color: #666; font-size: 0.85rem; margin-bottom: 1rem; }
  form { display: flex; gap: 0.5rem; flex-wrap: wrap; }
  #query { flex: 1 1 24rem; font-size: 1rem; padding: 0.5rem; }
  #token { flex: 0 1 12rem; padding: 0.5rem; }
  button { padding: 0.5rem 1rem; font-size: 1rem; }
  #status { margin: 0.8rem 0; color: #555; font-size: 0.9rem; }
  #status.error { color: #b00020; }
  ol { padding-left: 1.4rem; }
  li { margin-bottom: 0.9rem; }
  .title { font-weight: 600; }
  .meta { color: #666; font-size: 0.8rem; font-family: ui-monospace, monospace; }
  .snippet { font-size: 0.92rem; line-height: 1.35; }
</style>
</head>
<body>
<h1>densekit search</h1>
<div id="info"></div>
<form id="search-form">
  <input id="query" name="query" type="search" placeholder="Search the collection" autofocus required>
  <input id="token" name="token" type="password" placeholder="API token (if the service needs one)">
  <input id="k" name="k" type="number" min="1" max="100" value="10" style="width:4.5rem">
  <button id="go" type="submit">Search</button>
</form>
<div id="status"></div>
<ol id="results"></ol>
<script>
const form = document.getElementById("search-form");
const token = document.getElementById("token");
const statusLine = document.getElementById("status");
const results = document.getElementById("results");
token.value = sessionStorage.getItem("densekit-token") || "";

function headers() {
  const h = {"Content-Type": "application/json"};
  if (token.value) { h["Authorization"] = "Bearer " + token.value; }
  return h;
}

function snippet(text) {
  if (!text) { return ""; }
  return text.length > 300 ? text.slice(0, 300) + "\u2026" : text;
}

function show(message, isError) {
  statusLine.textContent = message;
  statusLine.className = isError ? "error" : "";
}

async function loadInfo() {
  const response = await fetch("info", {headers: headers()});
  if (!response.ok) { return; }
  const info = await response.json();
  const docs = info.documents === null ? "no texts" : info.documents + " documents";
  const module = info.active_module ? ", module " + info.active_module : "";
  document.getElementById("info").textContent =
    info.model + module + " \u00b7 " + info.index.type + " index of " + info.index.rows +
    " vectors \u00b7 " + docs;
}

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  sessionStorage.setItem("densekit-token", token.value);
  results.innerHTML = "";
  show("searching\u2026", false);
  const started = performance.now();
  let response;
  try {
    response = await fetch("search", {method: "POST", headers: headers(), body: JSON.stringify(
      {query: document.getElementById("query").value, k: Number(document.getElementById("k").value)})});
  } catch (err) {
    show("the service cannot be reached: " + err, true);
    return;
  }
  const body = await response.json();
  if (!response.ok) {
    const detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    show(response.status + ": " + detail, true);
    return;
  }
  const roundTrip = performance.now() - started;
  const hits = body.results[0];
  const missing = body.documents_unavailable ? " \u00b7 no texts: " + body.documents_unavailable : "";
  show(hits.length + " results in " + body.took_ms.toFixed(1) + " ms (search), " +
       roundTrip.toFixed(1) + " ms (round trip)" + missing, false);
  for (const hit of hits) {
    const item = document.createElement("li");
    item.className = "hit";
    const title = document.createElement("div");
    title.className = "title";
    title.textContent = hit.title || hit.id;
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = "id " + hit.id + " \u00b7 score " + hit.score.toFixed(4);
    const text = document.createElement("div");
    text.className = "snippet";
    text.textContent = snippet(hit.text);
    item.append(title, meta, text);
    item.dataset.id = hit.id;
    results.append(item);
  }
  loadInfo();
});
loadInfo();
</script>
</body>
</html>
"""
