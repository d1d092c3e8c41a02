"""The step loop's and the pipe reader's threads carry native names."""

import sys
import threading
from pathlib import Path

import pytest

from omnibus.common.threads import name_this_thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="native thread names are read from /proc")
def test_a_thread_names_itself_natively_truncated_to_15_bytes():
    seen = {}

    def run():
        name_this_thread("omnibus-a-very-long-name")
        seen["comm"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["comm"] == "omnibus-a-very-"
