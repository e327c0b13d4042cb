"""A screenshot of ``attnlab serve``'s live page (the README's ``docs/img/serve.png``).

Starts ``attnlab serve --checkpoint DIR`` on a free port, opens the page in headless Chromium
(selenium), types the prompt, picks a layer and a head, pins a token (or streams a generation) and
saves the page as a small PNG (a 256-colour palette keeps it well under 300 KB)::

    attnlab train --data shakespeare.txt --out runs/shakespeare
    python examples/serve_screenshot.py --checkpoint runs/shakespeare --out docs/img/serve.png
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="the model to serve")
    p.add_argument("--prompt", default="ROMEO:\nBut soft, what light", help="the prompt to type")
    p.add_argument("--layer", type=int, default=1)
    p.add_argument("--head", type=int, default=2)
    p.add_argument("--generate", type=int, default=0, help="tokens to stream and show (default 0: show the heads)")
    p.add_argument("--pin", type=int, default=-1, help="the token whose attention to highlight (default: the last)")
    p.add_argument("--out", type=Path, default=Path("docs/img/serve.png"))
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=1100)
    args = p.parse_args()

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "serve", "--checkpoint", args.checkpoint, "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    url = re.search(r" at (http://\S+?)/? \(", server.stdout.readline()).group(1)
    opts = Options()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"):
        opts.add_argument(flag)
    opts.add_argument(f"--window-size={args.width},{args.height}")
    os.environ.setdefault("SE_OFFLINE", "true")
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=shutil.which("chromedriver")))
    try:
        driver.get(url + "/")
        wait = WebDriverWait(driver, 120)
        wait.until(lambda d: d.execute_script("return document.body.dataset.ready"))
        driver.execute_script(
            "const b = document.getElementById('prompt'); b.value = arguments[0];"
            "b.dispatchEvent(new Event('input', {bubbles: true}));",
            args.prompt,
        )
        wait.until(lambda d: d.execute_script("return document.body.dataset.livePrompt === arguments[0]", args.prompt))
        Select(driver.find_element(By.ID, "layer-select")).select_by_value(str(args.layer))
        Select(driver.find_element(By.ID, "head-select")).select_by_value(str(args.head))
        tokens = driver.find_elements(By.CSS_SELECTOR, "#tokens .tok")
        tokens[args.pin].click()  # pinned: the strip shows where it attends
        if args.generate:
            driver.execute_script("document.getElementById('max-new').value = arguments[0]", str(args.generate))
            driver.find_element(By.ID, "generate").click()
            wait.until(lambda d: d.execute_script("return document.body.dataset.generationDone"))
            driver.find_element(By.ID, "gen-prev").click()  # a token in the middle of the text
        png = driver.get_screenshot_as_png()
    finally:
        driver.quit()
        server.send_signal(signal.SIGINT)
        server.wait(30)
    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(256)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    image.save(args.out, optimize=True)
    print(f"wrote {args.out}: {image.width}x{image.height}, {args.out.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
