// bertology attention viewer: head view and model view, drawn on canvas. No network, no innerHTML.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("bertology-data").textContent);
  const n = data.n, L = data.layers, H = data.heads;
  function decode(text) {
    const binary = atob(text);
    const bytes = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
    return bytes;
  }
  // Each view of attention (weights, norm shares, rollout), decoded once when first shown. A "topk" view keeps each row's
  // k largest weights, at key positions `indices`, and the row's mass left out (`rest`); `overview` holds the thumbnails.
  const decoded = {};
  function viewData(name) {
    if (!decoded[name]) {
      const view = data.views[name], topk = view.format === "topk";
      decoded[name] = { heads: view.heads, k: view.k || n, weights: decode(view.weights), overview: decode(view.overview),
                        indices: topk ? new Uint16Array(decode(view.indices).buffer) : null, rest: topk ? decode(view.rest) : null };
    }
    return decoded[name];
  }
  let current = viewData("attention");
  // The layers the page holds (viewer.py's layers_within: as many as its budget allows), each at its place in the arrays.
  const stored = data.stored_layers, slot = new Map(stored.map(function (layer, index) { return [layer, index]; }));
  // Calls fn(key, weight) for every stored weight of row (layer, head, query); a view with one map per layer (rollout) has it under head 0.
  function eachWeight(layer, head, query, fn) {
    const Hv = current.heads, weights = current.weights, indices = current.indices, k = current.k;
    if (Hv === 1) head = 0;
    if (indices === null) {
      const offset = ((slot.get(layer) * Hv + head) * n + query) * n;
      for (let j = 0; j < n; j++) { const w = weights[offset + j]; if (w) fn(j, w / 255); }
    } else {
      const offset = ((slot.get(layer) * Hv + head) * n + query) * k;
      for (let t = 0; t < k; t++) { const w = weights[offset + t]; if (w) fn(indices[offset + t], w / 255); }
    }
  }
  function drawnHeads() { return current.heads === 1 ? [0] : state.heads; }
  // The share of row (layer, head, query) that a "topk" view leaves out, in [0, 1].
  function restOf(layer, head, query) { return current.rest[(slot.get(layer) * current.heads + (current.heads === 1 ? 0 : head)) * n + query] / 255; }
  function colour(head, alpha) { return "hsla(" + Math.round(360 * head / H) + ",70%,45%," + alpha + ")"; }
  // WCAG 2 contrast of white text on hsl(hue, 70%, lightness): (1.05) / (L_bg + 0.05), L the relative luminance.
  function whiteContrast(hue, lightness) {
    const s = 0.7, l = lightness / 100, a = s * Math.min(l, 1 - l);
    const channel = function (k) { const c = l - a * Math.max(-1, Math.min((k + hue / 30) % 12 - 3, 9 - (k + hue / 30) % 12, 1)); return c <= 0.04045 ? c / 12.92 : Math.pow((c + 0.055) / 1.055, 2.4); };
    return 1.05 / (0.2126 * channel(0) + 0.7152 * channel(8) + 0.0722 * channel(4) + 0.05);
  }
  // A head's chip: its hue, darkened until white text on it reaches 4.5:1 (WCAG AA).
  function chipColour(head) {
    const hue = Math.round(360 * head / H);
    let lightness = 45;
    while (whiteContrast(hue, lightness) < 4.6 && lightness > 5) lightness -= 1;
    return "hsl(" + hue + ",70%," + lightness + "%)";
  }

  // The page opens on one head: the most distinctive of layer 0 (data.start_head, see bertology.viewer.distinctive_head).
  const state = { layer: stored[0], heads: new Set([data.start_head]), hover: null, queryFilter: "all", keyFilter: "all", view: "attention" };
  const viewer = { state: state, linesDrawn: 0, renderMs: 0, open: open };
  window.bertologyViewer = viewer;

  // ---- head view ----
  // The canvas is only as tall as the visible part of the token list (a scroll box holds the full height), and only
  // lines that cross the visible band are drawn: a 512-token input redraws as fast as a short one.
  const canvas = document.getElementById("head-canvas");
  const scroller = document.getElementById("head-scroll");
  const spacer = document.getElementById("head-spacer");
  const context = canvas.getContext("2d");
  const rowHeight = 16, top = 8, textWidth = 190, gap = 240, tokenChars = 24;
  const ratio = window.devicePixelRatio || 1;
  const width = 2 * textWidth + gap, fullHeight = top * 2 + n * rowHeight;
  const height = Math.min(fullHeight, Math.max(320, Math.round(window.innerHeight * 0.75)));
  canvas.width = width * ratio; canvas.height = height * ratio;
  canvas.style.width = width + "px"; canvas.style.height = height + "px";
  scroller.style.height = height + "px"; scroller.style.width = (width + 18) + "px";
  spacer.style.height = (fullHeight - height) + "px";
  context.scale(ratio, ratio);
  const leftX = textWidth - 6, rightX = textWidth + gap + 6;
  function y(i) { return top + i * rowHeight + rowHeight / 2 - scroller.scrollTop; }
  function shown(i, filter) { return filter === "all" || String(data.segments[i]) === filter; }
  // Long tokens are cut to tokenChars characters; hovering one shows it whole.
  function label(token) { return token.length > tokenChars ? token.slice(0, tokenChars - 1) + "\u2026" : token; }

  // Lines are drawn strongest first, viewer.linesPerFrame a frame: a layer switch shows its strongest lines in the next frame
  // and the faint ones follow; a new drawing cancels the one under way.
  viewer.linesPerFrame = 600;
  let drawing = 0;
  // A layer past the page's budget: no maps here, but the command that draws them.
  const missing = document.getElementById("missing-layer");
  function drawHead() {
    const started = performance.now();
    const generation = ++drawing;
    context.clearRect(0, 0, width, height);
    missing.hidden = slot.has(state.layer);
    if (!missing.hidden) {
      missing.textContent = "Layer " + state.layer + " is not on this page: to stay fast it holds the maps of layer" + (stored.length > 1 ? "s " : " ") +
        stored.join(", ") + " of " + L + ". Draw it with: bertology view TEXT --model " + data.model + " --layers " + state.layer +
        " (TEXT: the text above).";
      viewer.linesDrawn = 0; canvas.dataset.lines = "0"; viewer.drawing = false;
      return;
    }
    const hover = state.hover;
    const batches = [];
    for (const head of drawnHeads()) {
      // One path per head and alpha level: thousands of lines stay fast.
      const levels = new Map();
      for (let i = 0; i < n; i++) {
        if (!shown(i, state.queryFilter) || (hover && hover.side === "query" && hover.index !== i)) continue;
        const yi = y(i);
        eachWeight(state.layer, head, i, function (j, w) {
          if (w < 0.01 || !shown(j, state.keyFilter) || (hover && hover.side === "key" && hover.index !== j)) return;
          const yj = y(j);
          if ((yi < 0 && yj < 0) || (yi > height && yj > height)) return;  // the line misses the visible band
          const level = Math.min(20, Math.ceil(w * 20));
          if (!levels.has(level)) levels.set(level, []);
          levels.get(level).push(yi, yj);
        });
      }
      for (const [level, ends] of levels) batches.push({ head: head, level: level, ends: ends });
    }
    batches.sort(function (a, b) { return b.level - a.level; });
    drawTokens(hover);
    noteRow(hover);
    const total = batches.reduce(function (sum, batch) { return sum + batch.ends.length / 2; }, 0);
    viewer.linesDrawn = total;
    canvas.dataset.lines = String(total);
    viewer.drawing = true;
    let next = 0, offset = 0;
    function step() {
      if (generation !== drawing) return;
      let budget = viewer.linesPerFrame;
      while (next < batches.length && budget > 0) {
        const batch = batches[next], stop = Math.min(batch.ends.length, offset + 2 * budget);
        context.strokeStyle = colour(batch.head, Math.min(1, batch.level / 20 * 0.9 + 0.05));
        context.lineWidth = hover ? 2 : 1.2;
        context.beginPath();
        for (let p = offset; p < stop; p += 2) {
          context.moveTo(leftX + 4, batch.ends[p]);
          context.lineTo(rightX - 4, batch.ends[p + 1]);
        }
        context.stroke();
        budget -= (stop - offset) / 2;
        if (stop >= batch.ends.length) { next++; offset = 0; } else offset = stop;
      }
      if (next < batches.length) { requestAnimationFrame(step); return; }
      viewer.drawing = false;
      viewer.renderMs = performance.now() - started;
    }
    step();
  }

  // Hovering a query of a "topk" view names its strongest keys (its lines may leave the visible band) and the share of its
  // row beyond the k weights kept, a line for each head drawn.
  const rowNote = document.getElementById("row-note");
  function noteRow(hover) {
    if (rowNote === null) return;  // every weight is on the page
    if (!hover || hover.side !== "query") { rowNote.textContent = ""; return; }
    const lines = ["Token " + hover.index + " " + JSON.stringify(data.tokens[hover.index]) + ": its strongest keys; the share of its row beyond its " +
                   current.k + " largest weights"];
    Array.from(drawnHeads()).sort((a, b) => a - b).forEach(function (head) {
      const strongest = [];
      eachWeight(state.layer, head, hover.index, function (j, w) {  // largest first
        if (strongest.length < 3) strongest.push(j + " " + JSON.stringify(data.tokens[j]) + " " + (100 * w).toFixed(1) + "%");
      });
      lines.push((current.heads === 1 ? "" : "head " + head + ": ") + (strongest.join(", ") || "every weight under 0.2%") +
                 "; left out " + Math.round(100 * restOf(state.layer, head, hover.index)) + "%");
    });
    rowNote.textContent = lines.join("\n");
  }

  // A decoder's query sees only the keys at or before it: hovering a token greys the tokens it cannot see, or that cannot see it.
  function unseen(hover, side, i) {
    return !data.sees_later_keys && hover !== null && hover.side !== side && (hover.side === "query" ? i > hover.index : i < hover.index);
  }
  function drawTokens(hover) {
    context.font = "12px ui-monospace, monospace";
    context.textBaseline = "middle";
    const first = Math.max(0, Math.floor((scroller.scrollTop - top) / rowHeight)), last = Math.min(n, first + Math.ceil(height / rowHeight) + 2);
    for (let i = first; i < last; i++) {
      const dim = data.segments[i] === 1 ? "#7a4d00" : "#1d2330";
      for (const side of ["query", "key"]) {
        const active = hover && hover.side === side && hover.index === i;
        if (active) { context.fillStyle = "#ffe08a"; context.fillRect(side === "query" ? 0 : rightX - 2, y(i) - rowHeight / 2, textWidth - 2, rowHeight); }
        context.fillStyle = unseen(hover, side, i) ? "#b4b9c4" : dim;
        context.textAlign = side === "query" ? "right" : "left";
        context.fillText(label(data.tokens[i]), side === "query" ? leftX : rightX, y(i), textWidth - 10);
      }
    }
  }

  canvas.addEventListener("mousemove", function (event) {
    const box = canvas.getBoundingClientRect();
    const x = event.clientX - box.left, index = Math.floor((event.clientY - box.top + scroller.scrollTop - top) / rowHeight);
    let hover = null;
    if (index >= 0 && index < n) {
      if (x < textWidth) hover = { side: "query", index: index };
      else if (x > textWidth + gap) hover = { side: "key", index: index };
    }
    canvas.title = hover ? data.tokens[hover.index] : "";  // the whole token, however long
    if (JSON.stringify(hover) !== JSON.stringify(state.hover)) { state.hover = hover; drawHead(); }
  });
  canvas.addEventListener("mouseleave", function () { if (state.hover) { state.hover = null; drawHead(); } });
  let scrolling = false;
  scroller.addEventListener("scroll", function () {
    if (scrolling) return;
    scrolling = true;
    requestAnimationFrame(function () { scrolling = false; drawHead(); });
  });

  const layerSelect = document.getElementById("layer");
  for (let l = 0; l < L; l++) { const option = document.createElement("option"); option.value = String(l); option.textContent = String(l); layerSelect.appendChild(option); }
  // How long a layer switch takes until the next frame is painted (the browser test prints it).
  layerSelect.addEventListener("change", function () {
    const started = performance.now();
    state.layer = Number(layerSelect.value); updateTitle(); drawHead();
    requestAnimationFrame(function () { setTimeout(function () { viewer.switchMs = performance.now() - started; }, 0); });
  });
  const boxes = document.getElementById("head-boxes");
  const headInputs = [];
  for (let h = 0; h < H; h++) {
    const label = document.createElement("label");
    label.className = "head";
    label.style.background = chipColour(h);
    const input = document.createElement("input");
    input.type = "checkbox"; input.checked = state.heads.has(h); input.dataset.head = String(h);
    input.addEventListener("change", function () { if (input.checked) state.heads.add(h); else state.heads.delete(h); updateTitle(); drawHead(); });
    label.appendChild(input);
    label.appendChild(document.createTextNode(String(h)));
    boxes.appendChild(label);
    headInputs.push(input);
  }
  for (const [id, key] of [["query-filter", "queryFilter"], ["key-filter", "keyFilter"]]) {  // only for a pair of texts
    const select = document.getElementById(id);
    if (select === null) continue;
    select.addEventListener("change", function () { state[key] = select.value; drawHead(); });
  }
  function updateTitle() {
    const heads = Array.from(state.heads).sort((a, b) => a - b);
    const title = heads.length === 1 ? "Head view: layer " + state.layer + ", head " + heads[0] : "Head view: layer " + state.layer + " (" + heads.length + " heads)";
    document.getElementById("head-title").textContent = title;
    document.querySelectorAll(".thumb").forEach(function (thumb) {
      thumb.classList.toggle("selected", Number(thumb.dataset.layer) === state.layer && state.heads.has(Number(thumb.dataset.head)));
    });
  }

  // ---- model view ----
  function open(layer, head) {
    state.layer = layer; state.heads = new Set([head]); state.hover = null;
    layerSelect.value = String(layer);
    headInputs.forEach(function (input) { input.checked = Number(input.dataset.head) === head; });
    updateTitle(); drawHead();
    if (window.location.hash !== "#layer=" + layer + "&head=" + head) history.replaceState(null, "", "#layer=" + layer + "&head=" + head);
    document.getElementById("head-view").scrollIntoView();
  }
  const grid = document.getElementById("grid");
  grid.style.gridTemplateColumns = "repeat(" + H + ", max-content)";
  // A thumbnail is the whole map, max-pooled to size x size cells (overview_cells in viewer.py). On a decoder's map the
  // cells after the diagonal hold only keys their queries cannot see: grey, not the white of zero attention.
  const size = data.overview_size;
  const allLabels = new Set();
  function paint(small, l, h) {
    const image = small.getContext("2d").createImageData(size, size);
    const offset = (slot.get(l) * current.heads + (current.heads === 1 ? 0 : h)) * size * size;
    for (let r = 0; r < size; r++) {
      for (let c = 0; c < size; c++) {
        const p = r * size + c, hidden = !data.sees_later_keys && c > r;
        const v = hidden ? 222 : 255 - Math.round(255 * Math.sqrt(current.overview[offset + p] / 255));
        image.data[4 * p] = v; image.data[4 * p + 1] = v; image.data[4 * p + 2] = hidden ? 222 : 255; image.data[4 * p + 3] = 255;
      }
    }
    small.getContext("2d").putImageData(image, 0, 0);
  }
  for (const l of stored) {
    for (let h = 0; h < H; h++) {
      const thumb = document.createElement("div");
      thumb.className = "thumb"; thumb.dataset.layer = String(l); thumb.dataset.head = String(h);
      const small = document.createElement("canvas");
      small.width = size; small.height = size;
      paint(small, l, h);
      const name = document.createElement("span");
      name.textContent = l + "-" + h;
      const labels = document.createElement("span");
      labels.className = "labels";
      const own = data.labels[l + "-" + h] || [];
      own.forEach(function (label) { allLabels.add(label); });
      (data.label_chips[l + "-" + h] || []).forEach(function (pair) {  // short forms, never cut: the legend spells them out
        const chip = document.createElement("span");
        chip.textContent = pair[0].replace(/:/g, ":\u200b");  // a long one wraps after a colon
        chip.title = pair[1];
        labels.appendChild(chip);
      });
      labels.title = own.join(", ");  // the whole list on hover
      thumb.dataset.labels = JSON.stringify(own);
      thumb.title = "layer " + l + ", head " + h + (own.length ? ": " + own.join(", ") : "");
      thumb.append(small, name, labels);
      thumb.addEventListener("click", function () { open(l, h); });
      grid.appendChild(thumb);
    }
  }
  if (stored.length < L) {
    document.getElementById("missing-layers").textContent = "Layers " + stored.join(", ") + " of " + L + " are on this page (it computes at most " +
      "a budget of map cells, or the layers asked for); pick another layer above for the command that draws it.";
  }
  const legend = Object.entries(data.label_legend).map(function (pair) { return pair[0] + " = " + pair[1]; });
  document.getElementById("label-legend").textContent = legend.length ? "Labels (hover a cell for them in full): " + legend.join(", ") + "." : "";
  const labelFilter = document.getElementById("label-filter");
  Array.from(allLabels).sort().forEach(function (label) {
    const option = document.createElement("option"); option.value = label; option.textContent = label; labelFilter.appendChild(option);
  });
  labelFilter.disabled = allLabels.size === 0;
  labelFilter.addEventListener("change", function () {
    document.querySelectorAll(".thumb").forEach(function (thumb) {
      thumb.classList.toggle("hidden", labelFilter.value !== "" && !JSON.parse(thumb.dataset.labels).includes(labelFilter.value));
    });
  });

  // ---- views ----
  const viewSelect = document.getElementById("view");
  Object.keys(data.views).forEach(function (name) {
    const option = document.createElement("option"); option.value = name; option.textContent = data.views[name].title; viewSelect.appendChild(option);
  });
  function useView(name) {
    state.view = name; current = viewData(name); viewSelect.value = name;
    document.querySelectorAll(".thumb").forEach(function (thumb) {
      const h = Number(thumb.dataset.head);
      thumb.classList.toggle("shared", current.heads === 1 && h > 0);  // rollout: one map per layer, shown once
      if (current.heads !== 1 || h === 0) paint(thumb.querySelector("canvas"), Number(thumb.dataset.layer), h);
    });
    drawHead();
  }
  viewSelect.addEventListener("change", function () { useView(viewSelect.value); });
  viewer.useView = useView;

  const match = /layer=(\d+)&head=(\d+)/.exec(window.location.hash);
  if (match && Number(match[1]) < L && Number(match[2]) < H) open(Number(match[1]), Number(match[2]));
  else {
    document.getElementById("start-hint").textContent = "Opened on head " + data.start_head + " of layer " + stored[0] + ": its attention is the furthest " +
      "(Jensen-Shannon) from the layer's mean map on this input. Tick other heads to add them.";
    layerSelect.value = String(state.layer); updateTitle(); drawHead();
  }
  document.body.dataset.ready = "1";
})();
