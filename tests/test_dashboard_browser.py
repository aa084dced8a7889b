"""The live dashboard in a real browser: headless Chromium (Debian's ``chromium``
package, which ``make test`` installs) driven by Playwright, against a local
cluster with authorisation on (real nats-server, services, agent, dashboard).

A submitted job appears and turns running; a plan switch forced with
``gs.optimizer.reconfigure`` appears on the timeline with its phases; a
cancel from the page is refused for ``tools`` and for another tenant and
works for the job's own tenant. Screenshots go to ``$GEARSHIFT_SCREENSHOT_DIR``
(default: the test's tmp dir); their paths are printed.

``GEARSHIFT_DASHBOARD_CLUSTER=<data dir of a running gearshift up>`` runs the
same tests against that cluster instead of starting one (what
``python -m loadtest.observability`` does).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
from pathlib import Path

import pytest

from gearshift.cluster import LocalCluster

CHROMIUM = os.environ.get("GEARSHIFT_CHROMIUM", "/usr/bin/chromium")
TIMEOUT_MS = 60_000  # a busy 2-core machine; nothing here asserts a duration

if not Path(CHROMIUM).exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"{CHROMIUM} missing: `make test` installs Debian's chromium package")
    pytest.skip(f"{CHROMIUM} missing: `make test` installs Debian's chromium package", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")
sync_api.expect.set_options(timeout=TIMEOUT_MS)

PLAN_DP2 = {"dp": 2, "tp": 1, "pp": 1, "zero": 0, "offload": False, "ga": 1, "micro_batch": 8, "grad_ckpt": False}
PLAN_DP1 = {"dp": 1, "tp": 1, "pp": 1, "zero": 0, "offload": False, "ga": 2, "micro_batch": 8, "grad_ckpt": False}


def spec(name: str, tenant: str, gpus: int = 2, plan: dict | None = None) -> dict:
    return {
        "name": name, "tenant": tenant,
        "model": {"name": "gpt2", "params": 1560, "layers": 24, "hidden": 1920, "seq_len": 1024},
        "global_batch": 16, "steps": 100_000, "gpus": gpus, "plan": plan or PLAN_DP2, "step_time": 0.05,
    }


class Existing:
    """A running ``gearshift up`` found by its data dir."""

    def __init__(self, data_dir: str):
        self.root = Path(data_dir)
        admin = json.loads((self.root / "auth" / "admin.creds").read_text())
        self.url = admin["url"]
        self.auth_root = self.root / "auth"

    @property
    def dashboard_url(self) -> str:
        return json.loads((self.root / "observe" / "dashboard.json").read_text())["dashboard"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.environ.get("GEARSHIFT_DASHBOARD_CLUSTER"):
        yield Existing(os.environ["GEARSHIFT_DASHBOARD_CLUSTER"])
        return
    c = LocalCluster(nodes=1, gpus_per_node=4, port=-1, data_dir=str(tmp_path_factory.mktemp("dash")), interval=1.0,
                     grace=3.0, auth=True, tenants=["nlp", "vision"])
    with c:
        c.auth_root = c.auth_dir.root
        yield c


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    d = Path(os.environ.get("GEARSHIFT_SCREENSHOT_DIR") or tmp_path_factory.mktemp("screenshots"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def page(cluster):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        pg.set_default_timeout(TIMEOUT_MS)
        pg.goto(cluster.dashboard_url)
        sync_api.expect(pg.locator("#conn")).to_have_text("live", timeout=TIMEOUT_MS)
        yield pg
        browser.close()


def shoot(page, shots: Path, name: str) -> Path:
    path = shots / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def bus(cluster, coro_fn):
    """Run ``coro_fn(nc)`` with the admin identity."""
    from gearshift.bus.auth import connect_options, load_creds
    from gearshift.bus.client import connect

    async def go():
        nc = await connect(cluster.url, name="dash-test", retry_for=5,
                           **connect_options(load_creds(cluster.auth_root / "admin.creds")))
        try:
            return await coro_fn(nc)
        finally:
            await nc.drain()

    # Playwright's sync API keeps an event loop running in this thread
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, go()).result()


def submit(cluster, body: dict) -> str:
    from gearshift.bus.client import call
    from gearshift.bus_schema import subjects as subj
    from gearshift.bus_schema.messages import SubmitReply

    async def go(nc):
        return (await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": body}).encode(), SubmitReply)).job_id

    return bus(cluster, go)


def sign_in(page, cluster, user: str) -> None:
    page.locator("#login-box summary").click()
    page.fill("#creds", (cluster.auth_root / f"{user}.creds").read_text())
    page.click("#login")
    sync_api.expect(page.locator("#who")).to_contain_text(f"signed in as {user}")


def cancel_from_page(page, job_id: str):
    page.locator(f'button.cancel[data-job="{job_id}"]').first.click()
    result = page.locator("#action-result")
    sync_api.expect(result).to_contain_text(f"cancel {job_id}")
    return result


@pytest.fixture(scope="module")
def job(cluster):
    return submit(cluster, spec("dash-train", "nlp"))


def test_submitted_job_appears_and_turns_running(page, cluster, job, shots):
    row = page.locator(f'#running tr[data-job="{job}"]')
    sync_api.expect(row).to_have_attribute("data-state", "running")
    # its GPUs are coloured by it on the cluster grid, and its tenant holds them
    sync_api.expect(page.locator(f'.gpu[data-job="{job}"]')).to_have_count(2)
    sync_api.expect(page.locator('#tenants tr[data-tenant="nlp"] td').nth(1)).to_have_text("2")
    sync_api.expect(row.locator(".plan")).to_contain_text("DP2")
    # progress moves: live steps from the agent's progress reports
    sync_api.expect(row.locator(".progress")).not_to_contain_text(re.compile(r"^\s*0/100000"))
    sync_api.expect(page.locator(f'#events li[data-job="{job}"][data-kind="job.running"]')).to_have_count(1)
    shoot(page, shots, "1-running")


def test_switch_shows_on_the_timeline_with_its_phases(page, cluster, job, shots):
    from gearshift.bus.client import call
    from gearshift.bus_schema import subjects as subj
    from gearshift.bus_schema.messages import ReconfigureReply

    async def pin(nc):
        req = {"job_id": job, "plan": PLAN_DP1, "reason": "browser test"}
        return await call(nc, subj.OPTIMIZER + ".reconfigure", json.dumps(req).encode(), ReconfigureReply)

    assert bus(cluster, pin).pinned
    done = page.locator(f'#switches .switch[data-job="{job}"][data-done="1"]')
    sync_api.expect(done).to_have_count(1)
    assert "DP2" in done.inner_text() and "DP1" in done.inner_text()
    phases = [done.locator(".phase").nth(i).get_attribute("data-phase") for i in range(5)]
    assert phases == ["checkpoint", "teardown", "launch", "restore", "first_step"]
    sync_api.expect(page.locator(f'#events li[data-job="{job}"][data-kind="job.switched"]')).to_have_count(1)
    # after the switch the job runs the new plan on one GPU
    sync_api.expect(page.locator(f'#running tr[data-job="{job}"] .plan')).to_contain_text("DP1")
    sync_api.expect(page.locator(f'.gpu[data-job="{job}"]')).to_have_count(1)
    shoot(page, shots, "2-switch")


def test_cancel_from_the_page_is_refused_without_permission_and_works_with_it(page, cluster, job, shots):
    # not signed in: the page asks for credentials, nothing changes
    result = cancel_from_page(page, job)
    sync_api.expect(result).to_have_class("refused")
    # `tools` may only read events: the NATS server refuses the request
    sign_in(page, cluster, "tools")
    result = cancel_from_page(page, job)
    sync_api.expect(result).to_have_class("refused")
    sync_api.expect(result).to_contain_text("may not cancel")
    shoot(page, shots, "3-cancel-refused")
    # another tenant does not even see the job
    sign_in(page, cluster, "tenant-vision")
    result = cancel_from_page(page, job)
    sync_api.expect(result).to_have_class("refused")
    sync_api.expect(result).to_contain_text("no job")
    sync_api.expect(page.locator(f'#running tr[data-job="{job}"]')).to_have_attribute("data-state", "running")
    # its own tenant may
    sign_in(page, cluster, "tenant-nlp")
    result = cancel_from_page(page, job)
    sync_api.expect(result).to_have_class("ok")
    sync_api.expect(page.locator(f'#finished tr[data-job="{job}"]')).to_have_attribute("data-state", "cancelled")
    sync_api.expect(page.locator(f'.gpu[data-job="{job}"]')).to_have_count(0)
    shoot(page, shots, "4-cancelled")


def test_sign_in_with_a_wrong_key_is_refused_by_the_server(cluster):
    import urllib.error
    import urllib.request

    creds = json.loads((cluster.auth_root / "tenant-nlp.creds").read_text())
    from gearshift.bus.auth import new_user_seed

    creds["nkey_seed"] = new_user_seed()  # a well-formed key the server does not know
    req = urllib.request.Request(cluster.dashboard_url + "api/login", method="POST",
                                 data=json.dumps({"creds": json.dumps(creds)}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 401
    assert "unknown identity or wrong key" in json.loads(err.value.read())["error"]
