from __future__ import annotations

from aioinfer.gpu.cuda_graphs import capture_sizes, padded_size


def test_capture_sizes_follow_1_2_4_8_then_every_8():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(40)[-3:] == [24, 32, 40]
    # 512 at most (vLLM's largest): a step of more requests runs eagerly.
    assert capture_sizes(1024)[-1] == 512 and capture_sizes(520) == capture_sizes(512)
    assert padded_size(capture_sizes(1024), 513) is None


def test_padded_size_picks_the_smallest_bucket_that_fits():
    sizes = capture_sizes(32)
    assert [padded_size(sizes, n) for n in (1, 3, 5, 9, 17, 32)] == [1, 4, 8, 16, 24, 32]
    assert padded_size(sizes, 33) is None
