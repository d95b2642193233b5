"""The headless browser (one per test module that asks for it), for every page test in this folder."""

from tests.serve.test_view_browser import browser  # noqa: F401 (a fixture: Debian's chromium through Selenium)
