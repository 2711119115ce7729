"""The shared time helpers and Event manifests (kvpilot.kube.times, kvpilot.kube.events)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from kvpilot.kube.events import event_manifest
from kvpilot.kube.times import format_time, parse_time

T = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


@pytest.mark.parametrize(
    ("digits", "text"),
    [(0, "2026-01-02T03:04:05Z"), (3, "2026-01-02T03:04:05.678Z"), (6, "2026-01-02T03:04:05.678901Z")],
)
def test_format_time_from_a_datetime_or_epoch_seconds(digits: int, text: str) -> None:
    assert format_time(T, digits) == text
    assert format_time(T.timestamp(), digits)[:20] == text[:20]


def test_format_time_writes_utc_whatever_the_zone() -> None:
    plus_two = T.astimezone(timezone(timedelta(hours=2)))
    assert format_time(plus_two) == "2026-01-02T03:04:05Z"
    with pytest.raises(ValueError, match="digits"):
        format_time(T, 2)


def test_parse_time_round_trips_and_refuses_garbage() -> None:
    assert parse_time(format_time(T, 6)) == T
    assert parse_time("2026-01-02T03:04:05Z") == T.replace(microsecond=0)
    for garbage in (None, "", "yesterday", 12, ["2026-01-02T03:04:05Z"]):
        assert parse_time(garbage) is None


def test_event_manifest_refers_to_the_object_and_caps_the_message() -> None:
    body = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u1", "resourceVersion": "7"},
    }
    event = event_manifest(
        body,
        reason="ScaledUp",
        message="x" * 5000,
        event_type="Normal",
        component="kvpilot-autoscaler",
        reporting_component="kvpilot-autoscaler",
        reporting_instance="i" * 300,
        now=T,
    )
    assert event["metadata"]["namespace"] == "ml" and event["metadata"]["name"].startswith("chat.")
    assert event["involvedObject"] == {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "name": "chat",
        "namespace": "ml",
        "uid": "u1",
        "resourceVersion": "7",
    }
    assert len(event["message"]) == 1024 and len(event["reportingInstance"]) == 128
    assert event["firstTimestamp"] == event["lastTimestamp"] == "2026-01-02T03:04:05Z"
    # Without apiVersion/kind (a list item, say) it still names an InferenceModel.
    bare = event_manifest(
        {"metadata": {"name": "chat", "namespace": "ml"}},
        reason="R",
        message="m",
        event_type="Warning",
        component="c",
        reporting_component="c",
        reporting_instance="i",
    )
    assert (bare["involvedObject"]["apiVersion"], bare["involvedObject"]["kind"]) == (
        "kvpilot.dev/v1alpha1",
        "InferenceModel",
    )
