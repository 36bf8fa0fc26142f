// Headless Chromium over what a person sees (issue 38): a notebook deployment's Run form on a
// running Prefect server, and pages of the built docs site. Prints one JSON object on stdout;
// tests/test_browser.py runs it and checks what it says.
//
// Needs: Debian's chromium (`apt-get install -y chromium`) and playwright-core
// (`npm install --prefix /tmp/pwcore playwright-core`).
//
// Run (from the repository root, the site built into SITE_DIR):
//   NODE_PATH=/tmp/pwcore/node_modules node docs/run_form_check.mjs \
//     http://127.0.0.1:4200 <deployment-id> <site-dir> [<screenshot-dir>]
//
// Environment: CHROMIUM (default /usr/bin/chromium).

import { createRequire } from "node:module";
import { join, resolve } from "node:path";
import { pathToFileURL } from "node:url";

// NODE_PATH is honoured by require(), not by ESM imports.
const { chromium } = createRequire(import.meta.url)("playwright-core");

const [server, deploymentId, siteDir, shotDir] = process.argv.slice(2);
if (!server || !deploymentId || !siteDir) {
  console.error("usage: node docs/run_form_check.mjs <server-url> <deployment-id> <site-dir> [<screenshot-dir>]");
  process.exit(2);
}
const base = server.replace(/\/+$/, "");
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"],
});
const found = {};
try {
  const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
  page.setDefaultTimeout(60_000);

  // 1. The Run form: each field with the value it opens with (a nested field's too).
  await page.goto(`${base}/deployments/deployment/${deploymentId}/run`, { waitUntil: "networkidle" });
  await page.getByText("train_end (Optional)", { exact: true }).waitFor();
  found.fields = await page.locator(".schema-form-property").evaluateAll((properties) =>
    properties.map((property) => ({
      label: property.innerText.split("\n")[0],
      value: property.querySelector("input, textarea")?.value ?? null,
      nested: property.querySelectorAll(".schema-form-property").length,
    })),
  );
  if (shotDir) {
    const group = page.getByText("parameters (Optional)", { exact: true }).first();
    await group.evaluate((label) => label.scrollIntoView({ block: "start" }));
    await page.waitForLoadState("networkidle");
    await page.screenshot({ path: join(resolve(shotDir), "deployment-run-form.png") });
  }

  // 2. Docs pages: code blocks that run past their box (they should wrap), and the sync
  //    twins' signatures in the API reference.
  found.pages = {};
  for (const name of ["reference/api", "reference/cli", "how-to/s3", "how-to/deployments"]) {
    const url = pathToFileURL(join(resolve(siteDir), name, "index.html")).href;
    await page.goto(url, { waitUntil: "load" });
    found.pages[name] = await page.evaluate(() => ({
      code_blocks: document.querySelectorAll("pre > code").length,
      cut_off: [...document.querySelectorAll("pre > code")]
        .filter((code) => code.scrollWidth > code.clientWidth + 1)
        .map((code) => code.innerText.slice(0, 60)),
      signatures: [...document.querySelectorAll(".doc-signature")].map((s) =>
        s.innerText.replace(/\s+/g, " ").slice(0, 40),
      ),
    }));
  }
} finally {
  await browser.close();
}
console.log(JSON.stringify(found));
