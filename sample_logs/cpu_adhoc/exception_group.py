import asyncio, torch, torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
async def fetch(i):
    if i == 1: raise KeyError('input_ids')
    await asyncio.sleep(0.01)
async def load(rank):
    async with asyncio.TaskGroup() as tg:
        for i in range(2): tg.create_task(fetch(i + rank - 1))
@record
def main():
    dist.init_process_group("gloo")
    r = dist.get_rank()
    if r == 1:
        asyncio.run(load(r))
    t = torch.ones(1); dist.all_reduce(t)
    dist.destroy_process_group()
main()
