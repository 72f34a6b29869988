// The dashboard in a real browser (Debian's chromium, driven by playwright-core): log in with a
// one-time link, the Cluster view lists the cluster's nodes (the last one's GPU use too), the
// Jobs view lists a running job, its page shows a line its worker printed within 2 s, and Stop
// ends it (STOPPED; its devices free on the Cluster view). Then the Submit view uploads the hello example's folder (its topology
// previewed, an override taken), the new job's page follows its log to SUCCEEDED, a search finds
// the override's greeting, Download saves the log, the rank filter shows one rank's lines, and
// Re-run runs it again. A screenshot of every view goes to OUT_DIR.
// Usage: node dashboard.mjs LOGIN_LINK JOB_ID RELAY_FILE OUT_DIR HELLO_DIR NODE...
//   RELAY_FILE: the job's workers print the line this script writes there as soon as it appears
//   (the runtime fixture's `relay` driver).
//   HELLO_DIR: a folder with the hello example's job.toml and libhello.so (groups "model", 4
//   ranks, and "processor", 2 ranks).
import { chromium } from "playwright-core";
import { existsSync, readFileSync, writeFileSync, renameSync } from "node:fs";
import { join } from "node:path";

const [link, job, relay, out, hello, ...nodes] = process.argv.slice(2);
const fail = (why) => { console.error(`FAIL: ${why}`); process.exit(1); };
if (!nodes.length) fail("usage: node dashboard.mjs LOGIN_LINK JOB_ID RELAY_FILE OUT_DIR HELLO_DIR NODE...");
if (!existsSync(join(hello, "job.toml"))) fail(`HELLO_DIR ${hello} has no job.toml`);
const GREETING = "from-the-browser";

// Waits for the topology preview that answers a change after the one numbered `before` (the
// preview's data-seq), and returns its text; an error or a preview without `want` fails.
async function preview(page, before, want) {
  const pre = page.locator("#topology");
  // Locators only: the page's Content-Security-Policy forbids the eval that waitForFunction uses.
  await page.locator(`#topology:is([data-state="ok"], [data-state="error"]):not([data-seq="${before}"])`)
    .waitFor({ timeout: 10000 }).catch(async () =>
      fail(`no topology preview within 10 s; it shows: ${await pre.textContent().catch(() => "")} ` +
        `(folder: ${await page.locator("#folder-info").textContent().catch(() => "none")})`));
  const text = await pre.textContent();
  if (await pre.getAttribute("data-state") === "error") fail(`the topology preview is an error: ${text}`);
  if (!text.includes(want)) fail(`the topology preview does not show "${want}": ${text}`);
  return text;
}

const seq = async (page) => Number(await page.locator("#topology").getAttribute("data-seq") || 0);

// Clicks Submit and returns the id of the job whose page it leads to (another than `from`).
async function submit(page, from) {
  await page.click("#submit-job");
  const page_of = page.locator(`section#job[data-id]:not([data-id="${from}"])`);
  const refused = page.locator("#submit-error:not(:empty)");
  const r = await Promise.race([
    page_of.waitFor({ timeout: 60000 }).then(async () => ({ job: await page_of.getAttribute("data-id") })),
    refused.waitFor({ timeout: 60000 }).then(async () => ({ error: await refused.textContent() })),
  ]).catch(() => fail("Submit led to no job page within 60 s"));
  if (r.error) fail(`Submit was refused: ${r.error}`);
  return r.job;
}

// Waits for job `id`'s page to show it ended, and fails unless it SUCCEEDED.
async function succeeded(page, id) {
  const info = page.locator(`#job[data-id="${id}"] #job-info`);
  const state = info.locator(["SUCCEEDED", "FAILED", "STOPPED", "DROPPED", "ENDED"]
    .map((s) => `span.state-${s}`).join(", ")).first();
  await state.waitFor({ timeout: 60000 }).catch(() => fail(`job ${id} did not end within 60 s`));
  const s = await state.textContent();
  if (s !== "SUCCEEDED") {
    const log = await page.locator("#log").textContent();
    fail(`job ${id} ended ${s}, not SUCCEEDED: ${await info.textContent()}\nits log ends:\n${log.slice(-2000)}`);
  }
}

const browser = await chromium.launch({
  executablePath: "/usr/bin/chromium",
  headless: true,
  // This machine's network is closed: no background connections, no component updates.
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
try {
  const page = await browser.newPage();
  // What the page itself reports goes to the test log: a script error is a failure to explain.
  page.on("pageerror", (e) => console.error(`page error: ${e.message}`));
  page.on("dialog", (d) => d.accept());
  await page.goto(link);
  // The link asks first; its button logs in and leads to the Cluster view, with every node.
  await page.getByRole("button", { name: "Log in", exact: true }).click();
  for (const n of nodes) await page.getByRole("cell", { name: n, exact: true }).first().waitFor({ timeout: 10000 });
  const held = page.getByText(/^Reservations \([1-9][0-9]*\)$/);
  await held.waitFor({ timeout: 10000 });
  // The last node's agent samples its GPUs through the tests' stand-in NVML (37% and 1 GiB).
  const use = page.getByRole("cell", { name: "GPU 0: 37%, 1.0 GiB of 16.0 GiB; GPU 1: 5%, 0 bytes of 16.0 GiB" });
  await use.waitFor({ timeout: 10000 })
    .catch(() => fail(`the cluster view does not show the GPU use of ${nodes.at(-1)} (37% and 5%)`));
  await page.screenshot({ path: join(out, "cluster.png"), fullPage: true });
  console.log(`cluster view: ${nodes.length} nodes; ${await held.textContent()}; GPU use: ${await use.textContent()}`);

  await page.click("#nav-jobs");
  await page.getByRole("link", { name: job, exact: true }).waitFor({ timeout: 10000 });
  await page.getByText("RUNNING").first().waitFor({ timeout: 10000 });
  await page.screenshot({ path: join(out, "jobs.png"), fullPage: true });
  console.log(`jobs view: job ${job} RUNNING`);

  await page.getByRole("link", { name: job, exact: true }).click();
  await page.locator("#log").waitFor({ timeout: 10000 });
  // A line a worker prints now appears in the live log within 2 s.
  const line = `BROWSER-LINE-${process.pid}-${Date.now()}`;
  writeFileSync(relay + ".tmp", line + "\n");
  renameSync(relay + ".tmp", relay);  // whole, at once
  const printed = Date.now();
  await page.locator("#log", { hasText: line }).waitFor({ timeout: 2000 })
    .catch(() => fail(`"${line}" did not appear in the live log within 2 s`));
  console.log(`live log: "${line}" after ${Date.now() - printed} ms`);
  await page.screenshot({ path: join(out, "job.png"), fullPage: true });

  await page.getByRole("button", { name: "Stop now", exact: true }).click();
  // The state's own cell, not a word of the log.
  await page.locator("#job-info span.state-STOPPED").waitFor({ timeout: 20000 })
    .catch(() => fail(`job ${job} did not show STOPPED within 20 s of Stop now`));
  await page.screenshot({ path: join(out, "job-stopped.png"), fullPage: true });
  await page.click("#nav-cluster");
  await page.getByText("Reservations (0)").waitFor({ timeout: 10000 });
  await page.screenshot({ path: join(out, "cluster-after-stop.png"), fullPage: true });
  console.log("stopped: STOPPED, and its devices are free on the cluster view");

  // Submit: the hello example's folder; its topology is previewed before anything is sent.
  await page.click("#nav-submit");
  await page.locator("#folder").waitFor({ timeout: 10000 });
  await page.setInputFiles("#folder", hello);
  await preview(page, 0, "model");
  const chosen = await page.locator("#job-file").inputValue();
  if (chosen !== "job.toml") fail(`the job file chosen is "${chosen}", not job.toml`);
  await page.screenshot({ path: join(out, "submit.png"), fullPage: true });
  console.log(`submit view: ${await page.locator("#folder-info").textContent()}; the preview shows the groups`);

  const before = await seq(page);
  await page.fill("#overrides", `args.greeting=${GREETING}`);
  await preview(page, before, "model");
  console.log("submit view: the preview takes the override without an error");

  const first = await submit(page, 0);
  await succeeded(page, first);
  // The hello plugin's ranks log `greet received "GREETING"`; its driver prints what they said.
  await page.locator("#log", { hasText: GREETING }).waitFor({ timeout: 10000 })
    .catch(() => fail(`the log of job ${first} does not hold "${GREETING}"`));
  // Its topology where it ran, as `twinkle topology` draws it (folded until asked for).
  await page.locator("#job-topology-box summary").click();
  await page.locator("#job-topology", { hasText: "DeviceGroup: processor" }).waitFor({ timeout: 10000 })
    .catch(() => fail(`job ${first}'s page draws no topology with its groups`));
  await page.screenshot({ path: join(out, "job-hello.png"), fullPage: true });
  console.log(`submitted: job ${first} SUCCEEDED, its log holds "${GREETING}", its topology drawn`);

  // Search the log: the greeting's lines, counted, each highlighted.
  await page.fill("#log-search", GREETING);
  await page.getByRole("button", { name: "Search", exact: true }).click();
  const count = page.locator("#search-count", { hasText: /^[1-9][0-9]* matching lines?/ });
  await count.waitFor({ timeout: 10000 }).catch(async () =>
    fail(`the search found nothing: ${await page.locator("#search-count").textContent()}`));
  const hit = await page.locator("#search-results .hit").first().textContent();
  if (!hit.includes(GREETING)) fail(`the first match's line does not hold "${GREETING}": ${hit}`);
  await page.screenshot({ path: join(out, "search.png"), fullPage: true });
  console.log(`search: ${await count.textContent()}`);

  // Download: the log as job-ID.log.
  const [download] = await Promise.all([page.waitForEvent("download", { timeout: 10000 }),
    page.click("#log-download")]).catch(() => fail("Download saved no file within 10 s"));
  if (download.suggestedFilename() !== `job-${first}.log`)
    fail(`the download is named ${download.suggestedFilename()}, not job-${first}.log`);
  const saved = readFileSync(await download.path(), "utf8");
  if (!saved.includes(GREETING)) fail(`the downloaded log does not hold "${GREETING}"`);
  console.log(`download: job-${first}.log, ${saved.length} bytes`);

  // Filter: one rank's lines only, the stream restarted from the beginning with it.
  await page.locator('#log-rank option[value="model:0"]').waitFor({ state: "attached", timeout: 10000 })
    .catch(() => fail("the rank filter offers no model:0 (the job's placement lists no such rank)"));
  await page.selectOption("#log-rank", "model:0");
  await page.locator('#log-status[data-state="ended"]').waitFor({ timeout: 10000 })
    .catch(() => fail("the log filtered to model:0 did not reach its end within 10 s"));
  await page.locator("#log", { hasText: /\S/ }).waitFor({ timeout: 10000 })
    .catch(() => fail("the log filtered to model:0 is empty"));
  const lines = (await page.locator("#log").textContent()).split("\n").filter((l) => l);
  const other = lines.find((l) => l.startsWith("[processor:"));
  if (other) fail(`the log filtered to model:0 holds another rank's line: ${other}`);
  if (!lines.some((l) => l.startsWith("[model:0]"))) fail(`the log filtered to model:0 has none of its lines: ${lines[0]}`);
  console.log(`filter: model:0 shows ${lines.length} lines, none of the processor's`);

  // Re-run: the same job file and folder, its overrides prefilled; a new job that succeeds.
  await page.getByRole("button", { name: "Re-run", exact: true }).click();
  await page.locator("#rerun-what").waitFor({ timeout: 10000 });
  const overrides = await page.locator("#overrides").inputValue();
  if (!overrides.includes(GREETING)) fail(`the re-run's overrides are not the job's: "${overrides}"`);
  await preview(page, 0, "model");
  const second = await submit(page, first);
  await succeeded(page, second);
  await page.locator("#log", { hasText: GREETING }).waitFor({ timeout: 10000 })
    .catch(() => fail(`the log of job ${second}, the re-run, does not hold "${GREETING}"`));
  await page.screenshot({ path: join(out, "rerun.png"), fullPage: true });
  console.log(`re-run: job ${second} SUCCEEDED (a re-run of job ${first})`);
} finally {
  await browser.close();
}
