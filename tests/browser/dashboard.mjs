// The dashboard in a real browser (Debian's chromium, driven by playwright-core): log in with a
// one-time link, the Cluster view lists the cluster's nodes, the Jobs view lists a running job, its
// page shows a line its worker printed within 2 s, and Stop ends it (STOPPED; its devices free on
// the Cluster view). A screenshot of every view goes to OUT_DIR.
// Usage: node dashboard.mjs LOGIN_LINK JOB_ID RELAY_FILE OUT_DIR NODE...
//   RELAY_FILE: the job's workers print the line this script writes there as soon as it appears
//   (the runtime fixture's `relay` driver).
import { chromium } from "playwright-core";
import { writeFileSync, renameSync } from "node:fs";
import { join } from "node:path";

const [link, job, relay, out, ...nodes] = process.argv.slice(2);
const fail = (why) => { console.error(`FAIL: ${why}`); process.exit(1); };

const browser = await chromium.launch({
  executablePath: "/usr/bin/chromium",
  headless: true,
  // This machine's network is closed: no background connections, no component updates.
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
try {
  const page = await browser.newPage();
  page.on("dialog", (d) => d.accept());
  await page.goto(link);
  // The link asks first; its button logs in and leads to the Cluster view, with every node.
  await page.getByRole("button", { name: "Log in", exact: true }).click();
  for (const n of nodes) await page.getByRole("cell", { name: n, exact: true }).first().waitFor({ timeout: 10000 });
  const held = page.getByText(/^Reservations \([1-9][0-9]*\)$/);
  await held.waitFor({ timeout: 10000 });
  await page.screenshot({ path: join(out, "cluster.png"), fullPage: true });
  console.log(`cluster view: ${nodes.length} nodes; ${await held.textContent()}`);

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
  await page.getByText("STOPPED").first().waitFor({ timeout: 20000 });
  await page.screenshot({ path: join(out, "job-stopped.png"), fullPage: true });
  await page.click("#nav-cluster");
  await page.getByText("Reservations (0)").waitFor({ timeout: 10000 });
  await page.screenshot({ path: join(out, "cluster-after-stop.png"), fullPage: true });
  console.log("stopped: STOPPED, and its devices are free on the cluster view");
} finally {
  await browser.close();
}
