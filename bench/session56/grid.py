import pickle, sys, numpy as np
rec = pickle.load(open(f'/tmp/suffix_study_{sys.argv[1]}.pkl', 'rb')); P = float(sys.argv[2])
a = np.array([(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rec])
ratio, c, n, dep, acc1, acc = a.T
print('depth>=  ratio>=  n>=   share_of_positions  first_acc  mean_acc_len(k<=4)')
for d in (2, 3, 4, 5, 6, 8):
    for rt in (0.0, 0.9):
        for nn in (1, 2, 3):
            m = (dep >= d) & (ratio >= rt) & (n >= nn)
            if m.sum() > 50:
                print(f'{d:6d} {rt:7.1f} {nn:4d} {m.sum()/P:10.3f} {acc1[m].mean():10.3f} {acc[m].mean():8.2f}')
