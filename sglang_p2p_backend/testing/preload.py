"""What the drivers' fork server imports once (testing/forkserver.py): SGLang's modules a driver reaches up to
its manager, and the driver itself. Importing only: no plugin is loaded and nothing is started here, so each
forked driver sets SGLang up from its own environment."""

import sglang.srt.disaggregation.base.conn  # noqa: F401
import sglang.srt.disaggregation.common.conn  # noqa: F401
import sglang.srt.disaggregation.utils  # noqa: F401
import sglang.srt.distributed.parallel_state  # noqa: F401
import sglang.srt.layers.dp_attention  # noqa: F401
import sglang.srt.plugins  # noqa: F401
import sglang.srt.runtime_context  # noqa: F401
import sglang.srt.server_args  # noqa: F401

import sglang_p2p_backend.adapter.conn  # noqa: F401
import sglang_p2p_backend.testing.driver  # noqa: F401
