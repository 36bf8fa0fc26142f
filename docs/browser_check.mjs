// Browser check of the Prefect UI for prefect-sandbox (issue 7): headless Chromium opens a
// deployment's custom Run form and a finished flow run's Artifacts tab on a running Prefect
// server, and saves screenshots under docs/screenshots/.
//
// Needs: Debian's chromium (`apt-get install -y chromium`) and playwright-core
// (`npm install --prefix /tmp/pwcore playwright-core`), and a server with the co2-forecast
// deployment and a Completed run of it (see deployments/README.md).
//
// Run (from the repository root):
//   NODE_PATH=/tmp/pwcore/node_modules node docs/browser_check.mjs \
//     http://127.0.0.1:4200 <deployment-id> <flow-run-id> [<markdown-artifact-id>]
//
// Environment: CHROMIUM (default /usr/bin/chromium), OUT_DIR (default docs/screenshots).

import { createRequire } from "node:module";
import { mkdtempSync, rmSync, mkdirSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";

// NODE_PATH is honoured by require(), not by ESM imports.
const { chromium } = createRequire(import.meta.url)("playwright-core");

const [server, deploymentId, flowRunId, artifactId] = process.argv.slice(2);
if (!server || !deploymentId || !flowRunId) {
  console.error("usage: node docs/browser_check.mjs <server-url> <deployment-id> <flow-run-id> [<artifact-id>]");
  process.exit(2);
}
const base = server.replace(/\/+$/, "");
const outDir = resolve(process.env.OUT_DIR ?? "docs/screenshots");
mkdirSync(outDir, { recursive: true });

async function shot(page, name) {
  // Let fonts, charts and lazy content settle after the last request.
  await page.waitForLoadState("networkidle");
  await page.waitForTimeout(1000);
  const path = join(outDir, name);
  await page.screenshot({ path, fullPage: false });
  console.log(`${path} (${Math.round(statSync(path).size / 1024)} KB)`);
}

const profile = mkdtempSync(join(tmpdir(), "chromium-profile-"));
let context;
try {
  // A fresh, empty profile (playwright passes it as --user-data-dir).
  context = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    headless: true,
    args: [
      "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync",
    ],
    viewport: { width: 1400, height: 1000 },
  });
  const page = context.pages()[0] ?? (await context.newPage());
  page.setDefaultTimeout(30_000);

  // 1. The deployment's custom Run form: parameters, with backend and storage as block
  //    selectors. Pick the first saved LocalKernelBackend block, if any, to show the selector.
  await page.goto(`${base}/deployments/deployment/${deploymentId}/run`, { waitUntil: "networkidle" });
  await page.getByText("notebook", { exact: true }).first().waitFor();
  await page.getByRole("button", { name: "LocalKernelBackend", exact: true }).click();
  const backend = page.locator(".schema-form-property", { has: page.getByText("backend (Optional)") }).last();
  await backend.locator(".p-select-button__control").click();
  await page.keyboard.press("ArrowDown"); // opens the list when the click only focused it
  const option = page.getByRole("option").filter({ hasNotText: /^None$/ }).first();
  await option.waitFor({ timeout: 5000 }).then(() => option.click(), () => page.keyboard.press("Escape"));
  // The parameter list does not fit 1000 px at 100 %: shrink the form, scroll to its parameters.
  await page.locator("form").first().evaluate((form) => { form.style.zoom = "0.75"; });
  await page.getByText("Parameters", { exact: true }).first().evaluate((e) => e.scrollIntoView({ block: "start" }));
  await shot(page, "deployment-run-form.png");

  // 2. The finished flow run's Artifacts tab.
  await page.goto(`${base}/runs/flow-run/${flowRunId}`, { waitUntil: "networkidle" });
  await page.locator("li.p-tab", { hasText: "Artifacts" }).click();
  await page.getByText("pipeline-summary").first().waitFor();
  await page.locator("ul.p-tab-navigation").evaluate((tabs) => tabs.scrollIntoView({ block: "start" }));
  await shot(page, "flow-run-artifacts.png");

  // 3. The markdown summary artifact, rendered.
  if (artifactId) {
    await page.goto(`${base}/artifacts/artifact/${artifactId}`, { waitUntil: "networkidle" });
    await page.locator(".prefect-markdown, .markdown-renderer, article").first().waitFor();
    await shot(page, "pipeline-summary-artifact.png");
  }
} finally {
  await context?.close();
  rmSync(profile, { recursive: true, force: true });
}
