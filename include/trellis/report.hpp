// trellis::report: what a run shows a person: the progress line and loss curves as SVG.
// Host-only.
#pragma once

#include "trellis/report/loss_curve.hpp"  // defines: loss_curve_svg, write_loss_curve_svg, CurvePoint
#include "trellis/report/progress.hpp"    // defines: ProgressBar, ProgressInfo
