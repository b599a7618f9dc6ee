from turborlhf.evaluate import length_strata


def test_length_strata_by_hand():
    pairs = [{"chosen": "ab", "rejected": "abc"},   # chosen shorter
             {"chosen": "abcd", "rejected": "a"},   # chosen longer
             {"chosen": "xy", "rejected": "zw"},    # tie: not shorter, so the baseline gets it wrong
             {"chosen": "a", "rejected": "abcdef"}]  # chosen shorter
    correct = [True, True, False, False]
    s = length_strata(pairs, correct)
    assert s["shorter_wins"] == 0.5 and s["n_chosen_shorter"] == 2
    assert s["accuracy_chosen_shorter"] == 0.5      # pairs 0 and 3
    assert s["accuracy_chosen_not_shorter"] == 0.5  # pairs 1 and 2


def test_length_strata_empty_stratum_is_none():
    s = length_strata([{"chosen": "a", "rejected": "ab"}], [True])
    assert s["accuracy_chosen_shorter"] == 1.0 and s["accuracy_chosen_not_shorter"] is None
    assert length_strata([], [])["shorter_wins"] is None
