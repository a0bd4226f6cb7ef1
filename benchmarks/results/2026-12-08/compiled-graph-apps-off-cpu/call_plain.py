def call(self, args):
        arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1, arg7_1, arg8_1, arg9_1, arg10_1, arg11_1, arg12_1, arg13_1, arg14_1, arg15_1, arg16_1, arg17_1, arg18_1, arg19_1, arg20_1, arg21_1, arg22_1, arg23_1, arg24_1, arg25_1, arg26_1, arg27_1, arg28_1, arg29_1, arg30_1, arg31_1, arg32_1, arg33_1, arg34_1 = args
        args.clear()
        s72 = arg0_1
        s80 = arg6_1
        buf0 = empty_strided_cpu((s72, 256), (256, 1), torch.float32)
        buf1 = empty_strided_cpu((s72, 1), (1, s72), torch.float32)
        buf2 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        cpp_fused__to_copy_add_embedding_mean_mul_onednn_mm_pow_rsqrt_0(arg1_1, arg2_1, arg3_1, buf1, buf2, s72)
        del arg3_1
        # Topologically Sorted Source Nodes: [long, output_parallel, pow_1, variance, add, rsqrt, x_1, x_2, onednn_mm], Original ATen: [aten._to_copy, aten.embedding, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf0, buf2, None, arg4_1)
        del arg4_1
        buf7 = empty_strided_cpu((s72, 4, 32), (128, 32, 1), torch.float32)
        buf5 = reinterpret_tensor(buf7, (s72, 4, 16), (128, 32, 1), 0)  # alias
        buf6 = reinterpret_tensor(buf7, (s72, 4, 16), (128, 32, 1), 16)  # alias
        buf8 = empty_strided_cpu((s72, 128), (128, 1), torch.float32)
        buf11 = reinterpret_tensor(buf2, (s72, 2, 32), (64, 32, 1), 0); del buf2  # reuse
        buf9 = reinterpret_tensor(buf11, (s72, 2, 16), (64, 32, 1), 0)  # alias
        buf10 = reinterpret_tensor(buf11, (s72, 2, 16), (64, 32, 1), 16)  # alias
        cpp_fused_add_index_select_mul_split_split_with_sizes_sub_unsqueeze_view_1(buf0, arg7_1, arg5_1, buf5, buf6, buf9, buf10, s72)
        del buf10
        del buf5
        del buf6
        del buf9
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_kv_cache_update]
        buf12 = torch.ops.vllm.unified_kv_cache_update.default(buf11, reinterpret_tensor(buf0, (s72, 2, 32), (256, 32, 1), 192), arg8_1)
        buf13 = buf12
        del buf12
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep, output_4, unified_attention_with_output], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_attention_with_output]
        torch.ops.vllm.unified_attention_with_output.default(buf7, buf11, reinterpret_tensor(buf0, (s72, 2, 32), (256, 32, 1), 192), reinterpret_tensor(buf8, (s72, 4, 32), (128, 32, 1), 0), arg8_1, None, None, buf13)
        del arg8_1
        del buf13
        buf16 = reinterpret_tensor(buf11, (s72, 64), (64, 1), 0); del buf11  # reuse
        # Topologically Sorted Source Nodes: [output_4, unified_attention_with_output, onednn_mm_1], Original ATen: [aten.view]
        torch.ops._C.onednn_mm.default(buf16, buf8, None, arg9_1)
        del arg9_1
        buf19 = buf0; del buf0  # reuse
        buf20 = buf1; del buf1  # reuse
        buf21 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        cpp_fused__to_copy_add_embedding_mean_mul_onednn_mm_pow_rsqrt_2(buf16, arg1_1, arg2_1, arg10_1, buf20, buf21, s72)
        del arg10_1
        # Topologically Sorted Source Nodes: [long, output_parallel, x_4, pow_2, variance_1, add_4, rsqrt_1, x_5, x_6, onednn_mm_2], Original ATen: [aten._to_copy, aten.embedding, aten.add, aten.pow, aten.mean, aten.rsqrt, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf19, buf21, None, arg11_1)
        del arg11_1
        buf24 = buf21; del buf21  # reuse
        buf25 = buf8; del buf8  # reuse
        cpp_fused_mul_onednn_mm_silu_slice_3(buf19, buf25, s72)
        # Topologically Sorted Source Nodes: [silu, x_7, onednn_mm_3], Original ATen: [aten.slice, aten.silu, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf24, buf25, None, arg12_1)
        del arg12_1
        buf28 = buf19; del buf19  # reuse
        buf29 = buf20; del buf20  # reuse
        buf30 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        cpp_fused__to_copy_add_embedding_mean_mul_onednn_mm_pow_rsqrt_4(buf24, buf16, arg1_1, arg2_1, arg13_1, buf29, buf30, s72)
        del arg13_1
        # Topologically Sorted Source Nodes: [long, output_parallel, x_4, x_9, pow_3, variance_2, add_6, rsqrt_2, x_10, x_11, onednn_mm_4], Original ATen: [aten._to_copy, aten.embedding, aten.add, aten.pow, aten.mean, aten.rsqrt, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf28, buf30, None, arg14_1)
        del arg14_1
        buf35 = reinterpret_tensor(buf25, (s72, 4, 32), (128, 32, 1), 0); del buf25  # reuse
        buf33 = reinterpret_tensor(buf35, (s72, 4, 16), (128, 32, 1), 0)  # alias
        buf34 = reinterpret_tensor(buf35, (s72, 4, 16), (128, 32, 1), 16)  # alias
        buf36 = reinterpret_tensor(buf7, (s72, 128), (128, 1), 0); del buf7  # reuse
        buf39 = reinterpret_tensor(buf30, (s72, 2, 32), (64, 32, 1), 0); del buf30  # reuse
        buf37 = reinterpret_tensor(buf39, (s72, 2, 16), (64, 32, 1), 0)  # alias
        buf38 = reinterpret_tensor(buf39, (s72, 2, 16), (64, 32, 1), 16)  # alias
        cpp_fused_add_index_select_mul_split_split_with_sizes_sub_unsqueeze_view_1(buf28, arg7_1, arg5_1, buf33, buf34, buf37, buf38, s72)
        del buf33
        del buf34
        del buf37
        del buf38
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep_1], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_kv_cache_update]
        buf40 = torch.ops.vllm.unified_kv_cache_update.default(buf39, reinterpret_tensor(buf28, (s72, 2, 32), (256, 32, 1), 192), arg15_1)
        buf41 = buf40
        del buf40
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep_1, output_12, unified_attention_with_output_1], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_attention_with_output]
        torch.ops.vllm.unified_attention_with_output.default(buf35, buf39, reinterpret_tensor(buf28, (s72, 2, 32), (256, 32, 1), 192), reinterpret_tensor(buf36, (s72, 4, 32), (128, 32, 1), 0), arg15_1, None, None, buf41)
        del arg15_1
        del buf41
        buf44 = reinterpret_tensor(buf39, (s72, 64), (64, 1), 0); del buf39  # reuse
        # Topologically Sorted Source Nodes: [output_12, unified_attention_with_output_1, onednn_mm_5], Original ATen: [aten.view]
        torch.ops._C.onednn_mm.default(buf44, buf36, None, arg16_1)
        del arg16_1
        buf47 = buf28; del buf28  # reuse
        buf48 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        buf49 = buf29; del buf29  # reuse
        buf50 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        cpp_fused__to_copy_add_embedding_mean_mul_onednn_mm_pow_rsqrt_5(buf44, buf24, buf16, arg1_1, arg2_1, arg17_1, buf48, buf49, buf50, s72)
        del arg17_1
        del arg1_1
        del arg2_1
        del buf16
        del buf24
        # Topologically Sorted Source Nodes: [pow_4, variance_3, add_10, rsqrt_3, x_14, x_15, onednn_mm_6], Original ATen: [aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf47, buf50, None, arg18_1)
        del arg18_1
        buf53 = buf50; del buf50  # reuse
        buf54 = buf36; del buf36  # reuse
        cpp_fused_mul_onednn_mm_silu_slice_3(buf47, buf54, s72)
        # Topologically Sorted Source Nodes: [silu_1, x_16, onednn_mm_7], Original ATen: [aten.slice, aten.silu, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf53, buf54, None, arg19_1)
        del arg19_1
        buf57 = buf47; del buf47  # reuse
        buf58 = buf49; del buf49  # reuse
        buf59 = buf44; del buf44  # reuse
        cpp_fused_add_mean_mul_onednn_mm_pow_rsqrt_6(buf53, buf48, arg20_1, buf58, buf59, s72)
        del arg20_1
        # Topologically Sorted Source Nodes: [x_18, pow_5, variance_4, add_12, rsqrt_4, x_19, x_20, onednn_mm_8], Original ATen: [aten.add, aten.pow, aten.mean, aten.rsqrt, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf57, buf59, None, arg21_1)
        del arg21_1
        buf64 = reinterpret_tensor(buf54, (s72, 4, 32), (128, 32, 1), 0); del buf54  # reuse
        buf62 = reinterpret_tensor(buf64, (s72, 4, 16), (128, 32, 1), 0)  # alias
        buf63 = reinterpret_tensor(buf64, (s72, 4, 16), (128, 32, 1), 16)  # alias
        buf65 = reinterpret_tensor(buf35, (s72, 128), (128, 1), 0); del buf35  # reuse
        buf68 = reinterpret_tensor(buf59, (s72, 2, 32), (64, 32, 1), 0); del buf59  # reuse
        buf66 = reinterpret_tensor(buf68, (s72, 2, 16), (64, 32, 1), 0)  # alias
        buf67 = reinterpret_tensor(buf68, (s72, 2, 16), (64, 32, 1), 16)  # alias
        cpp_fused_add_index_select_mul_split_split_with_sizes_sub_unsqueeze_view_1(buf57, arg7_1, arg5_1, buf62, buf63, buf66, buf67, s72)
        del buf62
        del buf63
        del buf66
        del buf67
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep_2], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_kv_cache_update]
        buf69 = torch.ops.vllm.unified_kv_cache_update.default(buf68, reinterpret_tensor(buf57, (s72, 2, 32), (256, 32, 1), 192), arg22_1)
        buf70 = buf69
        del buf69
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep_2, output_20, unified_attention_with_output_2], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_attention_with_output]
        torch.ops.vllm.unified_attention_with_output.default(buf64, buf68, reinterpret_tensor(buf57, (s72, 2, 32), (256, 32, 1), 192), reinterpret_tensor(buf65, (s72, 4, 32), (128, 32, 1), 0), arg22_1, None, None, buf70)
        del arg22_1
        del buf70
        buf73 = reinterpret_tensor(buf68, (s72, 64), (64, 1), 0); del buf68  # reuse
        # Topologically Sorted Source Nodes: [output_20, unified_attention_with_output_2, onednn_mm_9], Original ATen: [aten.view]
        torch.ops._C.onednn_mm.default(buf73, buf65, None, arg23_1)
        del arg23_1
        buf76 = buf57; del buf57  # reuse
        buf77 = buf58; del buf58  # reuse
        buf78 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        cpp_fused_add_mean_mul_onednn_mm_pow_rsqrt_7(buf73, buf53, buf48, arg24_1, buf77, buf78, s72)
        del arg24_1
        # Topologically Sorted Source Nodes: [x_18, x_22, pow_6, variance_5, add_16, rsqrt_5, x_23, x_24, onednn_mm_10], Original ATen: [aten.add, aten.pow, aten.mean, aten.rsqrt, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf76, buf78, None, arg25_1)
        del arg25_1
        buf81 = buf78; del buf78  # reuse
        buf82 = buf65; del buf65  # reuse
        cpp_fused_mul_onednn_mm_silu_slice_3(buf76, buf82, s72)
        # Topologically Sorted Source Nodes: [silu_2, x_25, onednn_mm_11], Original ATen: [aten.slice, aten.silu, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf81, buf82, None, arg26_1)
        del arg26_1
        buf85 = buf76; del buf76  # reuse
        buf86 = buf77; del buf77  # reuse
        buf87 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        cpp_fused_add_mean_mul_onednn_mm_pow_rsqrt_8(buf81, buf73, buf53, buf48, arg27_1, buf86, buf87, s72)
        del arg27_1
        del buf86
        # Topologically Sorted Source Nodes: [x_18, x_22, x_27, pow_7, variance_6, add_18, rsqrt_6, x_28, x_29, onednn_mm_12], Original ATen: [aten.add, aten.pow, aten.mean, aten.rsqrt, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf85, buf87, None, arg28_1)
        del arg28_1
        del buf87
        buf92 = reinterpret_tensor(buf82, (s72, 4, 32), (128, 32, 1), 0); del buf82  # reuse
        buf90 = reinterpret_tensor(buf92, (s72, 4, 16), (128, 32, 1), 0)  # alias
        buf91 = reinterpret_tensor(buf92, (s72, 4, 16), (128, 32, 1), 16)  # alias
        buf93 = reinterpret_tensor(buf64, (s72, 128), (128, 1), 0); del buf64  # reuse
        buf96 = empty_strided_cpu((s72, 2, 32), (64, 32, 1), torch.float32)
        buf94 = reinterpret_tensor(buf96, (s72, 2, 16), (64, 32, 1), 0)  # alias
        buf95 = reinterpret_tensor(buf96, (s72, 2, 16), (64, 32, 1), 16)  # alias
        cpp_fused_add_index_select_mul_split_split_with_sizes_sub_unsqueeze_view_1(buf85, arg7_1, arg5_1, buf90, buf91, buf94, buf95, s72)
        del arg5_1
        del arg7_1
        del buf90
        del buf91
        del buf94
        del buf95
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep_3], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_kv_cache_update]
        buf97 = torch.ops.vllm.unified_kv_cache_update.default(buf96, reinterpret_tensor(buf85, (s72, 2, 32), (256, 32, 1), 192), arg29_1)
        buf98 = buf97
        del buf97
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep_3, output_28, unified_attention_with_output_3], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_attention_with_output]
        torch.ops.vllm.unified_attention_with_output.default(buf92, buf96, reinterpret_tensor(buf85, (s72, 2, 32), (256, 32, 1), 192), reinterpret_tensor(buf93, (s72, 4, 32), (128, 32, 1), 0), arg29_1, None, None, buf98)
        del arg29_1
        del buf92
        del buf98
        buf101 = reinterpret_tensor(buf96, (s72, 64), (64, 1), 0); del buf96  # reuse
        # Topologically Sorted Source Nodes: [output_28, unified_attention_with_output_3, onednn_mm_13], Original ATen: [aten.view]
        torch.ops._C.onednn_mm.default(buf101, buf93, None, arg30_1)
        del arg30_1
        buf104 = buf85; del buf85  # reuse
        buf105 = buf48; del buf48  # reuse
        buf106 = empty_strided_cpu((s72, 1), (1, s72), torch.float32)
        buf107 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        cpp_fused_add_mean_mul_onednn_mm_pow_rsqrt_9(buf105, buf101, buf81, buf73, buf53, arg31_1, buf106, buf107, s72)
        del arg31_1
        del buf101
        del buf53
        del buf73
        del buf81
        # Topologically Sorted Source Nodes: [pow_8, variance_7, add_22, rsqrt_7, x_32, x_33, onednn_mm_14], Original ATen: [aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf104, buf107, None, arg32_1)
        del arg32_1
        buf110 = buf107; del buf107  # reuse
        buf111 = buf93; del buf93  # reuse
        cpp_fused_mul_onednn_mm_silu_slice_3(buf104, buf111, s72)
        del buf104
        # Topologically Sorted Source Nodes: [silu_3, x_34, onednn_mm_15], Original ATen: [aten.slice, aten.silu, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf110, buf111, None, arg33_1)
        del arg33_1
        del buf111
        buf114 = buf106; del buf106  # reuse
        buf115 = buf105; del buf105  # reuse
        cpp_fused_add_mean_mul_pow_rsqrt_10(buf115, buf110, arg34_1, buf114, s72)
        del arg34_1
        return (buf115, )

runner = Runner(partitions=[])
call = runner.call
recursively_apply_fns = runner.recursively_apply_fns


def get_args():
    from torch._dynamo.testing import rand_strided
    arg0_1 = 4096
    arg1_1 = rand_strided((4096, ), (1, ), device='cpu', dtype=torch.int32)
    arg2_1 = rand_strided((1024, 64), (64, 1), device='cpu', dtype=torch.float32)
    arg3_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg4_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg5_1 = rand_strided((1024, 32), (32, 1), device='cpu', dtype=torch.float32)
    arg6_1 = 4096
    arg7_1 = rand_strided((4096, ), (1, ), device='cpu', dtype=torch.int64)
    import pickle
    global arg8_1
    arg8_1 = pickle.loads(b'\x80\x04\x95W\x00\x00\x00\x00\x00\x00\x00\x8c\x16vllm.utils.torch_utils\x94\x8c\tLayerName\x94\x93\x94)\x81\x94}\x94\x8c\x05value\x94\x8c\x1dmodel.layers.0.self_attn.attn\x94sb.')
    arg9_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg10_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg11_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg12_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg13_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg14_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    import pickle
    global arg15_1
    arg15_1 = pickle.loads(b'\x80\x04\x95W\x00\x00\x00\x00\x00\x00\x00\x8c\x16vllm.utils.torch_utils\x94\x8c\tLayerName\x94\x93\x94)\x81\x94}\x94\x8c\x05value\x94\x8c\x1dmodel.layers.1.self_attn.attn\x94sb.')
    arg16_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg17_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg18_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg19_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg20_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg21_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    import pickle
    global arg22_1
    arg22_1 = pickle.loads(b'\x80\x04\x95W\x00\x00\x00\x00\x00\x00\x00\x8c\x16vllm.utils.torch_utils\x94\x8c\tLayerName\x94\x93\x94)\x81\x94}\x94\x8c\x05value\x94\x8c\x1dmodel.layers.2.self_attn.attn\x94sb.')
    arg23_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg24_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg25_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg26_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg27_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg28_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    import pickle
    global arg29_1
    arg29_1 = pickle.loads(b'\x80\x04\x95W\x00\x00\x00\x00\x00\x00\x00\x8c\x16vllm.utils.torch_utils\x94\x8c\tLayerName\x94\x93\x94)\x81\x94}\x94\x8c\x05value\x94\x8c\x1dmodel.layers.3.self_attn.attn\x94sb.')
    arg30_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg31_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg32_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg33_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg34_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    return [arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1, arg7_1, arg8_1, arg9_1, arg10_1, arg11_1, arg12_1, arg13_1, arg14_1, arg15_1, arg16_1, arg17_1, arg18_1, arg19_1, arg20_1, arg21_1, arg22_1, arg23_1, arg24_1, arg25_1, arg26_1, arg27_1, arg28_1, arg29_1, arg30_1, arg31_1, arg32_1, arg33_1, arg34_1]


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._inductor.utils import print_performance
    fn = lambda: call(list(args))
    return print_performance(fn, times=times, repeat=repeat)


if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
    args = get_args()
    compiled_module_main('None', lambda times, repeat: benchmark_compiled_module(args, times=times, repeat=repeat))


