import sys; sys.path.insert(0, "tests")
import torch, meshfuse
import torch.distributed as dist
from meshfuse import DeviceMesh, DataType, shard_tensor
from meshfuse.examples.gpt import GptBlock, init_parameters
from meshfuse.runtime.collectives import record_communications
mesh = DeviceMesh(range(2))
block = GptBlock(2, 64, 64, 4, DataType.Float, mesh)
bwd = meshfuse.vjp(block)
rank = dist.get_rank()
x = torch.randn(2, 64, 64); p = init_parameters(64)
tvs = [block.x, *block.params.values()]
inputs = [shard_tensor(t, tv, rank) for t, tv in zip([x, *p.values()], tvs)]
outs = bwd.forward.execute(inputs)
args = bwd.backward_inputs([shard_tensor(torch.randn(2,64,64), block.y, rank)], inputs, outs)
text = bwd.explain(args, verbose=True)
if rank == 0:
    print(text.split("communications on rank 0:")[1].split("Fusion")[0])
    print("Program" + text.split("Program")[1])
