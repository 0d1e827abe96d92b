"""The suite runs on two pytest-xdist workers (`make test-py`: `-n 2 --dist loadgroup`). Tests are handed out one
by one, except that the tests of a file which share a module- or session-scoped fixture (a trained start, a parity
model) go to the same worker, so that the fixture is built once."""
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        definitions = [defs[-1] for defs in item._fixtureinfo.name2fixturedefs.values() if defs]
        # our own fixtures only: pytest's tmp_path_factory is session-scoped too, and cheap
        shared = [d for d in definitions if d.baseid and d.scope in ("module", "session")]
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
