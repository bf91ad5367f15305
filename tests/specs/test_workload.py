import numpy as np
import pytest

from hetserve.errors import SpecError
from hetserve.specs.workload import SLO, Workload, load_workload


def test_azure_trace_matches_its_readme():
    w = load_workload("azure-conv")
    assert len(w) == 19_366
    assert w.rate == pytest.approx(5.53, abs=0.01)
    assert w.mean_input == pytest.approx(1154.7, abs=0.1)
    assert w.mean_output == pytest.approx(211.1, abs=0.1)
    assert w.arrival_s[0] == 0 and np.all(np.diff(w.arrival_s) >= 0)


def test_classes_and_filters():
    w = Workload.from_lists("t", [0, 1, 2, 3], [600, 600, 100, 100], [10, 200, 200, 10])
    assert list(w.classes()) == ["HPLD", "HPHD", "LPHD", "LPLD"]
    assert len(w.of_class("LPHD")) == 1
    assert len(w.filter_lengths(max_input=512)) == 2
    assert len(w.filter_lengths(max_output=128)) == 2
    with pytest.raises(SpecError, match="HPLD"):
        w.of_class("XX")


def test_boundaries_are_strictly_more_than():
    w = Workload.from_lists("t", [0, 1], [512, 513], [128, 129])
    assert list(w.classes()) == ["LPLD", "HPHD"]


def test_rate_scaling():
    w = load_workload("azure-conv").head(1000)
    assert w.scale_rate(2).rate == pytest.approx(2 * w.rate)
    assert w.with_rate(3.0).rate == pytest.approx(3.0)
    with pytest.raises(SpecError):
        w.scale_rate(0)


def test_sharegpt_gets_poisson_arrivals():
    w = load_workload("sharegpt", rate=4.0, seed=1)
    assert len(w) == 30_731
    assert w.rate == pytest.approx(4.0, rel=0.03)
    gaps = np.diff(w.arrival_s)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.05)  # exponential gaps: CV 1
    assert np.array_equal(load_workload("sharegpt", rate=4.0, seed=1).arrival_s, w.arrival_s)


def test_plain_seconds_timestamps(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n10.5,5,6\n12.5,7,8\n")
    w = load_workload(p)
    assert list(w.arrival_s) == [0.0, 2.0] and list(w.input_tokens) == [5, 7]


@pytest.mark.parametrize("text,field", [
    ("a,b\n1,2\n", "(header)"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,x,3\n", "row"),
    ("num_prefill_tokens,num_decode_tokens\n0,3\n", "num_prefill_tokens/num_decode_tokens"),
    ("num_prefill_tokens,num_decode_tokens\n", "(rows)"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n2,4,5,99\n", "row"),  # a field the header does not name
])
def test_bad_trace_names_field(tmp_path, text, field):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(SpecError) as e:
        load_workload(p)
    assert f"field '{field}'" in str(e.value) and str(p) in str(e.value)


def test_repeat_and_slo():
    w = Workload.from_lists("t", [0, 1], [5, 5], [5, 5])
    assert len(w.repeat(3)) == 6 and np.all(np.diff(w.repeat(3).arrival_s) > 0)
    with pytest.raises(ValueError):
        SLO(ttft_s=-1)


def test_a_length_only_trace_says_its_poisson_rate_and_a_timed_one_has_none():
    assert load_workload("sharegpt").poisson_rate == 1.0  # the default, DEFAULT_SYNTHETIC_RATE
    assert load_workload("sharegpt", rate=3.0).poisson_rate == 3.0
    assert load_workload("azure-conv").poisson_rate is None


@pytest.mark.parametrize("name", ["sharegpt", "azure-conv"])
@pytest.mark.parametrize("rate", [1e308, float("nan")])
def test_a_rate_past_any_pool_is_refused(name, rate):
    with pytest.raises(SpecError, match="--rate"):
        load_workload(name, rate=rate)


@pytest.mark.parametrize("rows,line,got", [
    ("0,5,6\n-3,7,8\n1.0,9,9\n", 3, "-3"),  # a negative time after a later one
    ("1,5,6\n2,7,8\n1.5,9,9\n", 4, "1.5"),
    ("2023-11-16 18:15:50.99,5,6\n2023-11-16 18:15:46.68,7,8\n", 3, "2023-11-16 18:15:46.68"),
])
def test_a_time_before_the_row_above_is_refused_naming_the_line(tmp_path, rows, line, got):
    p = tmp_path / "unsorted.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    with pytest.raises(SpecError) as e:
        load_workload(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:{line}: field 'TIMESTAMP': expected times in non-decreasing order")
    assert f"line {line - 1}'s" in msg and msg.endswith(f"got {got!r}")


def test_a_trace_keeps_its_row_order_and_is_shifted_to_start_at_zero(tmp_path):
    # docs/design.md "Workload trace (CSV)": request k is data row k; the first arrival is at 0 s
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n-3,5,6\n-3,7,8\n\n0.5,9,10\n")
    w = load_workload(p)
    assert list(w.arrival_s) == [0.0, 0.0, 3.5] and list(w.input_tokens) == [5, 7, 9]
