/*
 * Tiled Attention: shows this pack's node translations on ComfyUI frontends that drop them.
 *
 * The bug. ComfyUI serves every pack's locales/<lang>/*.json at /i18n, and the frontend merges them into its
 * vue-i18n messages when it starts. Since ComfyUI_frontend PR #6076 (Oct 2025) the frontend loads its own messages of
 * a language only when that language is chosen, with setLocaleMessage(lang, ...), which REPLACES that language's
 * messages: the custom nodes' translations merged before are gone, and every pack's nodes show their English names,
 * input names and tooltips (the help pages, fetched per language, are not affected). PR #7214 (Dec 2025) fixed it:
 * the frontend merges /i18n again after loading a language. Frontend 1.32.9, the one ComfyUI 0.3.75 pins, has the
 * bug; 1.49.6, the one ComfyUI 0.33.0 pins, has the fix.
 *
 * How it tells. By the symptom, never by version: in the language the frontend shows, /i18n has this pack's
 * translation of a node but the frontend's messages lack it (vue-i18n `te` is false). It looks
 *  - when the frontend registers each of this pack's nodes (the `beforeRegisterNodeDef` hook: at start-up, and when
 *    the frontend refreshes the node definitions after the Language setting (Comfy.Locale) changed), and
 *  - once the frontend has loaded the language it shows after start-up or after a Comfy.Locale change (it checks
 *    every 100 ms, for at most a minute, until the frontend shows that language with its own messages).
 * It only reads: on a frontend that keeps the translations (1.49.6) it changes nothing.
 *
 * What it does on the symptom. Merges this pack's entries of that language from /i18n (its nodes, found by their
 * python_module, and the category names they use) into the frontend's messages, as the fixed frontend does, so that
 * input and output names and tooltips come out translated; and, in the hook, puts the translated name, description
 * and category on the node definition being registered (the frontend translated those just before, without this
 * pack's entries). It records each language it restored in <html data-tiled-attention-restored-locales="ja ru">.
 * Other packs' nodes keep what the frontend gives them. Anything unexpected (no Vue app, another i18n, no /i18n)
 * makes it do nothing; it never throws into the frontend.
 */
const PACK = decodeURIComponent((import.meta.url.match(/\/extensions\/([^/]+)\//) || [])[1] || "");
const MODULE = `custom_nodes.${PACK}`; // the python_module ComfyUI gives this pack's nodes
const MARKER = "tiledAttentionRestoredLocales"; // <html data-tiled-attention-restored-locales>
const POLL_MS = 100;
const POLL_FOR_MS = 60_000;

let served = null; // /i18n: {lang: {nodeDefs: {id: {...}}, nodeCategories: {...}, ...}}
// this pack's node ids -> the category path segments seen in their registrations ("model_patches", "attention"; a
// segment the frontend had translated shows translated, so each registration adds its own)
const ourNodes = new Map();
const polls = new Map(); // language -> timer of afterLanguageLoads

/** The frontend's vue-i18n composer (i18n.global), or null where the frontend is not built the way this expects. */
function frontendI18n() {
  const vueApp = document.querySelector("#vue-app")?.__vue_app__;
  const symbol = vueApp?.__VUE_I18N_SYMBOL__;
  const composer = symbol ? vueApp._context?.provides?.[symbol]?.global : null;
  const needed = ["t", "te", "getLocaleMessage", "mergeLocaleMessage"];
  return composer?.locale && needed.every((f) => typeof composer[f] === "function") ? composer : null;
}

function shownLocale(composer) {
  return typeof composer.locale === "string" ? composer.locale : composer.locale.value;
}

/** Merges this pack's /i18n entries for `locale` into the frontend's messages where the frontend lacks them (the
 * bug); returns whether it merged anything. */
function restore(composer, locale, ids) {
  const lang = served?.[locale];
  const missing = ids.filter((id) => lang?.nodeDefs?.[id]?.display_name
    && !composer.te(`nodeDefs.${id}.display_name`, locale));
  if (!missing.length) return false;
  const nodeDefs = Object.fromEntries(missing.map((id) => [id, lang.nodeDefs[id]]));
  const nodeCategories = {};
  for (const id of missing) {
    for (const part of ourNodes.get(id) || []) {
      if (lang.nodeCategories?.[part] && !composer.te(`nodeCategories.${part}`, locale)) {
        nodeCategories[part] = lang.nodeCategories[part];
      }
    }
  }
  composer.mergeLocaleMessage(locale, { nodeDefs, nodeCategories });
  const root = document.documentElement.dataset;
  const restored = (root[MARKER] || "").split(" ").filter(Boolean);
  if (!restored.includes(locale)) {
    root[MARKER] = [...restored, locale].join(" ");
    console.info(`[tiled-attention] this frontend dropped the pack's ${locale} node translations when it loaded the ` +
      "language (fixed in ComfyUI_frontend PR #7214); restored them from /i18n");
  }
  return true;
}

/** Once the frontend shows `locale` with its own messages (it replaced what it had merged from /i18n), restore this
 * pack's entries if they are gone. Polls: the frontend announces neither the load nor its end. */
function afterLanguageLoads(locale) {
  if (!locale || !served?.[locale] || polls.has(locale)) return;
  const until = Date.now() + POLL_FOR_MS;
  const check = () => {
    try {
      const composer = frontendI18n();
      const own = composer ? Object.keys(composer.getLocaleMessage(locale) || {}) : [];
      // the frontend's own files bring sections (g, menu, ...) that no /i18n of packs carries
      if (composer && shownLocale(composer) === locale && own.some((k) => !(k in served[locale]))) {
        polls.delete(locale);
        restore(composer, locale, [...ourNodes.keys()]);
        return;
      }
    } catch (error) {
      console.warn("[tiled-attention] translations check failed", error);
    }
    if (Date.now() < until) polls.set(locale, setTimeout(check, POLL_MS));
    else polls.delete(locale);
  };
  check();
}

/** A category path in the frontend's current language, segment by segment (as the frontend's app.getNodeDefs). */
function translatedCategory(composer, category) {
  return category.split("/")
    .map((part) => (composer.te(`nodeCategories.${part}`) ? composer.t(`nodeCategories.${part}`) : part))
    .join("/");
}

const extension = {
  name: "tiled-attention.keep-translations",

  async init(app) {
    try {
      if (!PACK || !frontendI18n()) return;
      const api = window.comfyAPI?.api?.api;
      served = api?.getCustomNodesI18n ? await api.getCustomNodesI18n()
        : await (await api.fetchApi("/i18n")).json();
      app?.ui?.settings?.addEventListener?.("Comfy.Locale.change", (event) => afterLanguageLoads(event?.detail?.value));
    } catch (error) {
      served = null;
      console.warn("[tiled-attention] /i18n not read; translations are left to the frontend", error);
    }
  },

  beforeRegisterNodeDef(nodeType, nodeDef) {
    try {
      if (!served || nodeDef?.python_module !== MODULE) return;
      const composer = frontendI18n();
      if (!composer) return;
      const id = nodeDef.name;
      ourNodes.set(id, new Set([...(ourNodes.get(id) || []), ...(nodeDef.category || "").split("/")]));
      if (!restore(composer, shownLocale(composer), [id])) return;
      // the frontend translated this definition before the entries were back: translate it again
      const key = `nodeDefs.${id}`;
      nodeDef.display_name = composer.t(`${key}.display_name`);
      if (nodeDef.description && composer.te(`${key}.description`)) {
        nodeDef.description = composer.t(`${key}.description`);
      }
      if (nodeDef.category) nodeDef.category = translatedCategory(composer, nodeDef.category);
    } catch (error) {
      console.warn("[tiled-attention] translations check failed", error);
    }
  },

  setup(app) {
    try {
      if (served) afterLanguageLoads(app?.extensionManager?.setting?.get?.("Comfy.Locale"));
    } catch (error) {
      console.warn("[tiled-attention] translations check failed", error);
    }
  },
};

try {
  window.comfyAPI?.app?.app?.registerExtension(extension);
} catch (error) {
  console.warn("[tiled-attention] keep-translations not registered", error);
}
