"""fetch.Tries and fetch.Node without threads or trio: a batch's retries and a storage
node's up and down, as the Fetcher applies them after each try."""
import logging

from fusefs.fetch import Node, Tries


def test_without_io_timeout_a_batch_retries_then_gives_up():
    tries = Tries(retries=2, backoff=0.1, max_backoff=2.0, io_timeout=0)
    assert not tries.gives_up(["a"], node_down=False)
    assert tries.next(["a"], now=0.0, node_down=False) == (["a"], 0.1)
    assert tries.next(["a"], now=0.1, node_down=False) == (["a"], 0.2)
    assert tries.gives_up(["a"], node_down=False)  # (retries spent: the node does not answer)
    assert tries.next(["a"], now=0.3, node_down=True) == ([], 0.4)
    # a node already down: its samples are not tried again, whatever the tries left
    fresh = Tries(retries=5, backoff=0.1, max_backoff=2.0, io_timeout=0)
    assert fresh.gives_up(["b"], node_down=True)
    assert fresh.next(["b"], now=0.0, node_down=True)[0] == []


def test_with_io_timeout_a_batch_waits_for_its_node_until_the_timeout():
    tries = Tries(retries=1, backoff=1.0, max_backoff=2.0, io_timeout=5.0)
    assert tries.next(["a"], now=10.0, node_down=False) == (["a"], 1.0)   # (first failure at 10)
    assert tries.next(["a"], now=11.0, node_down=True) == (["a"], 2.0)    # down, still within 5 s
    assert tries.next(["a"], now=14.0, node_down=True) == (["a"], 1.0)    # the wait cut to the timeout
    assert tries.next(["a"], now=15.0, node_down=True) == ([], 2.0)       # past it: given up
    assert tries.next([], now=16.0, node_down=False)[0] == []             # nothing failed


def test_a_node_says_once_that_it_is_down_and_once_that_it_answers_again(caplog):
    node = Node("brick1", retries=4, io_timeout=0)
    with caplog.at_level(logging.WARNING, logger="fusefs"):
        node.answered()  # (up already: nothing said)
        node.does_not_answer(OSError(5, "EIO"))
        node.does_not_answer(OSError(5, "EIO"))
        node.stats.retries += 3
        node.stats.failed_samples += 2
        node.answered()
        node.answered()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "brick1 marked down after 4 retries" in said[0]
    assert "answers again" in said[1] and "3 retries while it was down, 2 sample(s) failed" in said[1]
    assert node.counters() == {"requests": 0, "reads": 0, "samples": 0, "bytes": 0, "errors": 0,
                               "retries": 3, "failed_samples": 2, "down": False, "inflight": 0}
