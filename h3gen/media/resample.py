"""Audio resampling by libswresample (PyAV), in chunks: memory and time grow with the sound's length only."""

from fractions import Fraction

import numpy as np


def resample_stream(waveform: np.ndarray, rate: int, new_rate: int, chunk: int = 1 << 16) -> np.ndarray:
    """`(channels, samples)` float32 audio at `rate` resampled to `new_rate` by libswresample (PyAV), fed in chunks
    of `chunk` samples: memory and time grow with the sound's length only, whatever the two rates are (a
    windowed-sinc filter built from their ratio does not: 44101 -> 32000 Hz would need 1.4 billion taps)."""
    import av

    channels = waveform.shape[0]
    layout = "mono" if channels == 1 else "stereo"
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=new_rate)
    out = []
    for start in range(0, waveform.shape[-1], chunk):
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(waveform[:, start : start + chunk], np.float32), format="fltp", layout=layout
        )
        frame.sample_rate = rate
        frame.pts = start
        frame.time_base = Fraction(1, rate)
        out += [resampled.to_ndarray() for resampled in resampler.resample(frame)]
    out += [resampled.to_ndarray() for resampled in resampler.resample(None)]
    return np.concatenate(out, axis=-1) if out else np.zeros((channels, 0), np.float32)
